"""The interface every admission policy of the simulator implements.

A policy sees each attempt before the engine does and answers Send (send it now), Queue
(it queues the attempt and releases it later through `dispatch`) or Refuse (a 429, with or
without Retry-After). It hears when attempts end, and may ask for in-flight ones to be evicted.
A policy that queues may also give up on a queued attempt later (a queue time-out), or evict
in-flight ones from its dispatch loop: the host collects both through `aftermath`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class SimRequest:
    """One attempt, as a gateway sees it."""

    req_id: str
    tenant: str
    entitlement: str
    prompt_tokens: int
    output_tokens: int  # what the engine will generate (the simulator knows; a gateway doesn't)
    max_tokens: int
    sent_at: float
    priority: int = 0  # the engine priority a policy sends (vLLM's: lower is served first)
    continues: str = ""  # a resumed request: the id of the request it continues ("": none)
    # admitted within its entitlement's baseline (None: the policy does not say)
    within: bool | None = None

    def continuation(self, req_id: str, generated: int, now: float) -> SimRequest:
        """The request that resumes this one after `generated` output tokens: its prompt is
        the original and the text so far, it asks for what is left (sim/suspension.py)."""
        return SimRequest(
            req_id,
            self.tenant,
            self.entitlement,
            self.prompt_tokens + generated,
            self.output_tokens - generated,
            self.max_tokens - generated,
            now,
            self.priority,
            continues=self.continues or self.req_id,
        )


@dataclass(slots=True)
class Send:
    evict: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Queue:
    evict: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Refuse:
    reason: str
    retry_after_s: float | None = None


Verdict = Send | Queue | Refuse


@dataclass(slots=True)
class Aftermath:
    """What a queueing policy decided outside `admit`: in-flight attempts to terminate, and
    queued ones it refuses after all (request id, reason), answered without Retry-After."""

    evict: list[str] = field(default_factory=list)
    refuse: list[tuple[str, str]] = field(default_factory=list)
    wake_at: float | None = None  # run a dispatch cycle then, though nothing else happens


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """One serving replica as an endpoint picker scrapes it: requests waiting in the engine,
    running, its slots and the share of its KV cache in use."""

    waiting: int
    running: int
    slots: int
    kv_usage: float


class Cluster(Protocol):
    """What a policy may read about the engines behind it."""

    @property
    def waiting(self) -> int: ...

    @property
    def running(self) -> int: ...

    @property
    def slots(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def endpoints(self) -> list[EndpointLoad]: ...


@dataclass(frozen=True, slots=True)
class TenantLimits:
    rpm: float
    tpm: float
    concurrency: int
    sheddable: bool


class AdmissionPolicy:
    name = "none"
    holds_requests = False  # keeps attempts and releases them through `dispatch`
    # What an eviction does to the attempts it takes back: end them (the client retries), or
    # suspend them (kept, and resumed through `admit` when it admits their continuation).
    suspends = False

    def admit(self, req: SimRequest, now: float) -> Verdict:
        return Send()

    def suspend_deadline_s(self, req: SimRequest) -> float:
        """How long a suspended attempt may wait to resume before it ends (policies that
        suspend)."""
        return 0.0

    def dispatch(self, now: float, free_slots: int) -> list[SimRequest]:
        """Queued attempts to send now. The host calls it again after sending them, until it
        returns none, so a policy may release one at a time and look at the engines again."""
        return []

    def aftermath(self, now: float) -> Aftermath:
        """Evictions and late refusals decided since the last call (after dispatch, on ticks)."""
        return Aftermath()

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        pass

    def ended_early(self, req: SimRequest, now: float) -> None:
        """The attempt ended without completing (evicted by this policy, or failed)."""

    def tick(self, now: float) -> list[str]:
        return []

    def capacity(self, fraction: float, throughput_fraction: float, now: float) -> list[str]:
        """Each replica now has `fraction` of its slots and KV, `throughput_fraction` of its
        token throughput; returns in-flight requests to evict."""
        return []

    def scores(self, now: float) -> dict[str, tuple[float, float]]:
        """(debt, priority) per tenant, for policies that have them."""
        return {}

    def desired_replicas(self, now: float) -> int | None:
        """Replicas the pool should have, for policies that scale it (None: static)."""
        return None

    def set_replicas(self, replicas: int, now: float) -> list[str]:
        """Replicas that serve changed; returns in-flight requests to evict."""
        return []

    def join(self, entitlement: str, now: float) -> None:
        """An entitlement is created (a tenant joins)."""

    def leave(self, entitlement: str, now: float) -> list[str]:
        """An entitlement ends; returns in-flight requests that must end with it."""
        return []

    def restart(self, now: float, store_kept: bool = False) -> None:
        """The gateway restarts on an empty store (a rolling update with the memory store):
        what is in flight finishes on the engines, unknown to the new process. Only
        tokenpools models it; the other policies keep their state."""
