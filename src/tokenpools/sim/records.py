"""What a run records, in the simulator and over HTTP alike (`tokenpools load`): a client's
logical requests (jobs), each attempt with its outcome and timings, periodic samples of the
engines and the policy, and the result that metrics, reports and figures read."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from tokenpools.model.config import Config
from tokenpools.sim.policy import SimRequest
from tokenpools.sim.scenario import Scenario, Tenant
from tokenpools.sim.workload import sample_length, workload_at


@dataclass(slots=True)
class Job:
    """One logical request of a client, across its attempts."""

    tenant: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    tries: int = 0
    client: int | None = None  # closed-loop client that sent it

    def request(self, req_id: str, entitlement: str, sent_at: float) -> SimRequest:
        return SimRequest(
            req_id,
            self.tenant,
            entitlement,
            self.prompt_tokens,
            self.output_tokens,
            self.max_tokens,
            sent_at,
        )


def new_job(tenant: Tenant, rng: random.Random, t: float, client: int | None = None) -> Job:
    """A tenant's next logical request, drawn from its workload as it is at time t."""
    w, _ = workload_at(tenant, t)
    output = sample_length(w.output, rng)
    return Job(
        tenant.name,
        sample_length(w.prompt, rng),
        output,
        max(w.max_tokens or output, output),
        client=client,
    )


@dataclass(slots=True)
class Attempt:
    req: SimRequest
    job: Job
    number: int  # 1 for a job's first attempt
    outcome: str = "pending"  # completed | rejected | evicted
    reason: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    output_tokens: int = 0
    started_at: float | None = None  # handed to an engine
    # What an evicted attempt held for nothing: its time in the engine and ∫ its KV dt.
    wasted_slot_s: float = 0.0
    wasted_kv_token_s: float = 0.0
    # Suspension (a policy that suspends): how often, for how long in all, and the prompt
    # tokens its continuations prefilled again (not served from the engine's prefix cache).
    suspensions: int = 0
    resumes: int = 0
    suspended_s: float = 0.0
    recomputed_tokens: int = 0


@dataclass(slots=True)
class Sample:
    t: float
    waiting: int
    running: int
    slots: int
    kv_usage: float
    running_by_tenant: dict[str, int]
    scores: dict[str, tuple[float, float]]  # tenant → (debt, priority)
    rejected_by_tenant: dict[str, int]  # since the previous sample
    low_priority_by_tenant: dict[str, int]


@dataclass
class RunResult:
    scenario: Scenario
    policy: str
    seed: int
    config: Config
    attempts: list[Attempt]
    samples: list[Sample]
    output_tokens: dict[tuple[str, str], int]  # (tenant, phase) → output tokens generated
    gave_up: Counter[str] = field(default_factory=Counter)
    replica_seconds: float = 0.0  # replicas provisioned × time (starting and draining too)
    peak_replicas: int = 0
    scaling: list[tuple[float, str]] = field(default_factory=list)  # (t, ask | serve | drain)
