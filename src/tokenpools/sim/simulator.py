"""The event loop: engine steps, capacity changes, joins and leaves, policy ticks, samples;
the clients that send the requests are sim/clients.py.

Deterministic: every random draw comes from a per-tenant random.Random seeded from the scenario
seed and the tenant's name, and simultaneous events run in the order they were scheduled.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable
from functools import partial

from tokenpools.engine.model import Engine, StepResult
from tokenpools.engine.profile import EngineProfile, load_profile
from tokenpools.model.config import ConfigError
from tokenpools.sim.autoscaler import Autoscaler, ReplicaMeter
from tokenpools.sim.baselines import tenant_limits
from tokenpools.sim.clients import Clients
from tokenpools.sim.dispatch import Dispatcher
from tokenpools.sim.policies import make_policy
from tokenpools.sim.policy import AdmissionPolicy, EndpointLoad, SimRequest
from tokenpools.sim.records import Attempt, RunResult, Sample
from tokenpools.sim.scenario import Scenario


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        seed: int | None = None,
        profile: EngineProfile | None = None,  # instead of the scenario's (calibration)
    ) -> None:
        self.scenario = scenario
        self.seed = scenario.seed if seed is None else seed
        self.config = scenario.config()
        self.profile: EngineProfile = profile or load_profile(scenario.engine.profile)
        pool = next(iter(self.config.pools.values()))
        if pool.replicas != scenario.engine.replicas:
            raise ConfigError(
                f"scenario {scenario.name!r}: pool {pool.name!r} has {pool.replicas} replicas, "
                f"the engine {scenario.engine.replicas}"
            )
        self.engines = [Engine(self.profile) for _ in range(scenario.engine.replicas)]
        self.busy = [False] * len(self.engines)
        self.serving = list(range(len(self.engines)))  # replicas that take new requests
        self.draining: set[int] = set()  # take no new requests; released when empty
        self.released: set[int] = set()
        self.meter = ReplicaMeter(len(self.engines), 0.0)
        self.scaling: list[tuple[float, str]] = []  # the autoscaler's actions
        self.fraction = 1.0  # of each replica's slots and KV (capacity events)
        self.tenants = {t.name: t for t in scenario.tenants}
        self.rng = {t.name: random.Random(f"{self.seed}/{t.name}") for t in scenario.tenants}
        self._joining = {
            t.name: t.entitlement or t.name for t in scenario.tenants if t.entitlement_while_active
        }
        layered = frozenset(t.entitlement or t.name for t in scenario.tenants if t.layered)
        self.policy: AdmissionPolicy = make_policy(
            policy,
            self.config,
            tenant_limits(scenario, self.config),
            cluster=self,
            now=0.0,  # the simulation's start
            absent=frozenset(self._joining.values()),
            layered=layered,
            llmd=scenario.llmd,
        )
        self.policy_name = policy
        self.now = 0.0
        # (time, rank, sequence, action): at one instant rank 0 (joins) goes first, then the
        # rest in the order scheduled; the sequence keeps actions from ever being compared.
        self._heap: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.active: dict[str, Attempt] = {}  # by request id, admitted and not yet ended
        self.where: dict[str, int] = {}  # request id → the replica serving it
        self.samples: list[Sample] = []
        self.output_tokens: Counter[tuple[str, str]] = Counter()
        self.clients = Clients(self)
        self.dispatcher = Dispatcher(self)

    # -- the cluster, as policies see it ----------------------------------------------------

    @property
    def waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def running(self) -> int:
        return sum(e.num_running for e in self.engines)

    @property
    def slots(self) -> int:
        return sum(self.engines[i].profile.max_num_seqs for i in self.serving)

    @property
    def kv_usage(self) -> float:
        serving = self.serving
        return sum(self.engines[i].kv_usage for i in serving) / max(1, len(serving))

    @property
    def free_slots(self) -> int:
        """Slots of the serving replicas that no running or waiting request holds."""
        return sum(
            max(0, e.profile.max_num_seqs - e.num_running - e.num_waiting)
            for e in (self.engines[i] for i in self.serving)
        )

    @property
    def endpoints(self) -> list[EndpointLoad]:
        """The serving replicas as a picker reads them, without scrape lag: a request handed
        to an engine counts as waiting at once (docs/simulation.md, llm-d)."""
        return [
            EndpointLoad(e.num_waiting, e.num_running, e.profile.max_num_seqs, e.kv_usage)
            for e in (self.engines[i] for i in self.serving)
        ]

    # -- scheduling ---------------------------------------------------------------------------

    def at(self, t: float, action: Callable[[], None], first: bool = False) -> None:
        heapq.heappush(self._heap, (t, 0 if first else 1, next(self._seq), action))

    def run(self, progress: Callable[[float], None] | None = None) -> RunResult:
        end = self.scenario.duration_s
        self.clients.start()
        # Joining tenants are added before anyone's first request at the same instant.
        for name, ent in self._joining.items():
            tenant = self.tenants[name]
            w = tenant.workload
            joins = max(0.0, w.start_s - tenant.entitlement_lead_s)
            self.at(joins, partial(self._join, ent), first=True)
            if w.end_s is not None:
                self.at(w.end_s, partial(self._leave, ent))
        for event in self.scenario.capacity:
            self.at(event.at_s, partial(self._capacity, event.fraction))
        for restart in self.scenario.restarts:
            self.at(
                restart.at_s, partial(self.policy.restart, restart.at_s, restart.store == "kept")
            )
        self.at(0.0, self._tick)
        self.at(0.0, self._sample)
        spec = self.scenario.autoscaling
        if spec is not None and spec.enabled:
            pool = next(iter(self.config.pools.values()))
            Autoscaler(spec, self, pool.min_replicas, pool.max_replicas).start()
        for phase in self.scenario.phases:
            self.at(phase.start_s, partial(self._phase_edge, phase.name, -1))
            self.at(min(phase.end_s, end), partial(self._phase_edge, phase.name, 1))
        next_report = 0.0
        while self._heap:
            t, _, _, action = heapq.heappop(self._heap)
            if t > end:
                break
            self.now = t
            action()
            if progress is not None and t >= next_report:
                progress(t)
                next_report = t + 1.0
        self.now = end
        self.meter.advance(end)
        return RunResult(
            self.scenario,
            self.policy_name,
            self.seed,
            self.config,
            self.clients.attempts,
            self.samples,
            dict(self.output_tokens),
            self.clients.gave_up,
            replica_seconds=self.meter.seconds,
            peak_replicas=self.meter.peak,
            scaling=self.scaling,
        )

    # -- engines ------------------------------------------------------------------------------

    def to_engine(self, req: SimRequest) -> None:
        index = min(
            self.serving,
            key=lambda i: (self.engines[i].num_running + self.engines[i].num_waiting, i),
        )
        self.engines[index].add(req.req_id, req.prompt_tokens, req.output_tokens, req.tenant)
        self.where[req.req_id] = index
        attempt = self.active.get(req.req_id)
        if attempt is not None:
            attempt.started_at = self.now
        if not self.busy[index]:
            self._step(index)

    def _step(self, index: int) -> None:
        engine = self.engines[index]
        if not engine.has_work:
            self.busy[index] = False
            if index in self.draining:
                self.release(index)
            return
        self.busy[index] = True
        result = engine.step()
        self.at(self.now + result.duration_s, lambda: self._step_done(index, result))

    def _step_done(self, index: int, result: StepResult) -> None:
        now = self.now
        for req_id in result.first_tokens:
            attempt = self.active.get(req_id)
            if attempt is not None and attempt.first_token_at is None:
                attempt.first_token_at = now
        for seq in result.finished:
            attempt = self.active.pop(seq.req_id, None)
            self.where.pop(seq.req_id, None)
            if attempt is None:
                continue
            attempt.outcome, attempt.finished_at = "completed", now
            attempt.output_tokens = seq.generated
            self.policy.finished(attempt.req, seq.generated, now)
            self.clients.job_done(attempt.job)
        self._step(index)
        if self.policy.holds_requests:
            self.dispatch_queued()

    def evict(self, req_id: str) -> None:
        attempt = self.active.pop(req_id, None)
        index = self.where.pop(req_id, None)
        generated = 0
        if index is not None:
            generated = self.engines[index].generated(req_id)
            self.engines[index].abort(req_id)
        if attempt is None:
            return
        if attempt.started_at is not None:  # the work thrown away (its KV grew linearly)
            held = self.now - attempt.started_at
            attempt.output_tokens = generated
            attempt.wasted_slot_s = held
            attempt.wasted_kv_token_s = held * (attempt.req.prompt_tokens + generated / 2)
        attempt.outcome, attempt.reason, attempt.finished_at = "evicted", "evicted", self.now
        self.policy.ended_early(attempt.req, self.now)
        self.clients.retry_or_give_up(attempt.job, None)

    def dispatch_queued(self) -> None:
        self.dispatcher.cycle()

    # -- timeline -----------------------------------------------------------------------------

    def _capacity(self, fraction: float) -> None:
        """Every replica keeps `fraction` of its slots and KV. Its token throughput does not
        scale the same way (a step has a fixed cost), so the pool's is scaled by what the
        profile says the smaller batch delivers — what an operator would re-measure."""
        self.fraction = fraction
        seqs, blocks = self.profile.limits_at(fraction)
        for engine in self.engines:
            engine.resize(seqs, blocks)
        smaller = self.profile.model_copy(update={"max_num_seqs": seqs})
        throughput = smaller.output_tokens_per_s() / self.profile.output_tokens_per_s()
        for req_id in self.policy.capacity(fraction, throughput, self.now):
            self.evict(req_id)

    def replicas_changed(self) -> None:
        """Replicas were added or drained (the autoscaler): tell the policy, act on it."""
        gone = self.draining | self.released
        self.serving = [i for i in range(len(self.engines)) if i not in gone]
        for req_id in self.policy.set_replicas(len(self.serving), self.now):
            self.evict(req_id)
        if self.policy.holds_requests:
            self.dispatch_queued()

    def release(self, index: int) -> None:
        """A drained replica is empty: it goes back (and stops costing replica-seconds)."""
        self.draining.discard(index)
        self.released.add(index)
        self.meter.change(-1, self.now)

    def _phase_edge(self, phase: str, sign: int) -> None:
        """Output tokens of a phase = the engines' cumulative counts at its end minus at its
        start (tokens of a step in progress at an edge count where the step began)."""
        for engine in self.engines:
            for tag, tokens in engine.output_tokens_by_tag().items():
                self.output_tokens[(tag, phase)] += sign * tokens

    def _join(self, entitlement: str) -> None:
        self.policy.join(entitlement, self.now)

    def _leave(self, entitlement: str) -> None:
        for req_id in self.policy.leave(entitlement, self.now):
            self.evict(req_id)

    def _tick(self) -> None:
        for req_id in self.policy.tick(self.now):
            self.evict(req_id)
        if self.policy.holds_requests:
            self.dispatcher.aftermath()
        self.at(self.now + 0.5, self._tick)

    def _sample(self) -> None:
        running: Counter[str] = Counter()
        for engine in self.engines:
            running.update(engine.running_by_tag)
        self.samples.append(
            Sample(
                t=self.now,
                waiting=sum(e.scheduled_waiting for e in self.engines),
                running=self.running,
                slots=self.slots,
                kv_usage=self.kv_usage,
                running_by_tenant={k: v for k, v in running.items() if v},
                scores=self.policy.scores(self.now),
                rejected_by_tenant=dict(self.clients.rejected),
                low_priority_by_tenant=dict(self.clients.low_priority),
            )
        )
        self.clients.rejected.clear()
        self.clients.low_priority.clear()
        self.at(self.now + self.scenario.sample_interval_s, self._sample)


def simulate(
    scenario: Scenario,
    policy: str,
    seed: int | None = None,
    progress: Callable[[float], None] | None = None,
    profile: EngineProfile | None = None,
) -> RunResult:
    return Simulation(scenario, policy, seed, profile).run(progress)


__all__ = ["RunResult", "Simulation", "simulate"]
