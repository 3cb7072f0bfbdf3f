"""One run of a scenario: the collaborators built and wired, the scenario's events put on the
timeline (joins and leaves, capacity changes, gateway restarts, policy ticks, samples, phase
edges), and the run's result.

The collaborators hold no reference to the run, and each changes only its own state:
- `Timeline` (sim/timeline.py): the clock and the queue of events;
- `Replicas` (sim/replicas.py): the engines, which of them serve, what they cost — the cluster
  the policy reads;
- `Clients` (sim/clients.py): arrivals, attempts through the policy, retries, giving up;
- `InFlight` (sim/in_flight.py): admitted attempts on the replicas until they end, and the
  dispatch cycle of a policy that queues;
- `Autoscaler` (sim/autoscaler.py): replicas added and drained, where the scenario scales.

Deterministic: every random draw comes from a per-tenant random.Random seeded from the scenario
seed and the tenant's name, and simultaneous events run in the order they were scheduled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from functools import partial

from tokenpools.engine.model import Engine
from tokenpools.engine.profile import EngineProfile, load_profile
from tokenpools.model.config import ConfigError
from tokenpools.sim.autoscaler import Autoscaler
from tokenpools.sim.baselines import tenant_limits
from tokenpools.sim.clients import Clients
from tokenpools.sim.in_flight import InFlight
from tokenpools.sim.policies import make_policy
from tokenpools.sim.policy import AdmissionPolicy, Queue, Send
from tokenpools.sim.records import Attempt, RunResult, Sample
from tokenpools.sim.replicas import Replicas
from tokenpools.sim.scenario import Scenario
from tokenpools.sim.suspension import Suspended
from tokenpools.sim.timeline import Timeline


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        seed: int | None = None,
        *,
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
        self.tenants = {t.name: t for t in scenario.tenants}
        self._joining = {
            t.name: t.entitlement or t.name for t in scenario.tenants if t.entitlement_while_active
        }
        layered = frozenset(t.entitlement or t.name for t in scenario.tenants if t.layered)
        self.timeline = Timeline()
        self.replicas = Replicas(
            self.profile, scenario.engine.replicas, scenario.engine.scheduling_policy
        )
        self.policy: AdmissionPolicy = make_policy(
            policy,
            self.config,
            tenant_limits(scenario, self.config),
            cluster=self.replicas,
            now=0.0,  # the simulation's start
            absent=frozenset(self._joining.values()),
            layered=layered,
            llmd=scenario.llmd,
        )
        self.policy_name = policy
        self.clients = Clients(
            self.tenants,
            seed=self.seed,
            profile=self.profile,
            timeline=self.timeline,
            policy=self.policy,
            admitted=self._admitted,
        )
        self.in_flight = InFlight(
            policy=self.policy, timeline=self.timeline, replicas=self.replicas, clients=self.clients
        )
        self.autoscaler: Autoscaler | None = None  # where the scenario scales the pool
        self.samples: list[Sample] = []
        self.output_tokens: Counter[tuple[str, str]] = Counter()  # (tag, phase) → tokens

    @property
    def engines(self) -> list[Engine]:
        return self.replicas.engines

    @property
    def running(self) -> Mapping[str, Attempt]:
        """Attempts on the replicas, by the id of the request the engine runs."""
        return self.in_flight.attempts

    @property
    def suspended(self) -> Mapping[str, Suspended]:
        """Suspended attempts, by their original request id."""
        return self.in_flight.suspension.waiting

    def _admitted(self, attempt: Attempt, verdict: Send | Queue) -> None:
        # Clients hand admitted attempts to InFlight, which tells them how each ended: the
        # one call of the pair that has to be bound after both exist.
        self.in_flight.admitted(attempt, verdict)

    def run(self, progress: Callable[[float], None] | None = None) -> RunResult:
        at = self.timeline.at
        end = self.scenario.duration_s
        self.clients.start()
        # Joining tenants are added before anyone's first request at the same instant.
        for name, ent in self._joining.items():
            tenant = self.tenants[name]
            w = tenant.workload
            joins = max(0.0, w.start_s - tenant.entitlement_lead_s)
            at(joins, partial(self._join, ent), first=True)
            if w.end_s is not None:
                at(w.end_s, partial(self._leave, ent))
        for event in self.scenario.capacity:
            at(event.at_s, partial(self._capacity, event.fraction))
        for restart in self.scenario.restarts:
            at(restart.at_s, partial(self.policy.restart, restart.at_s, restart.store == "kept"))
        at(0.0, self._tick)
        at(0.0, self._sample)
        spec = self.scenario.autoscaling
        if spec is not None and spec.enabled:
            pool = next(iter(self.config.pools.values()))
            self.autoscaler = Autoscaler(
                spec,
                bounds=(pool.min_replicas, pool.max_replicas),
                timeline=self.timeline,
                replicas=self.replicas,
                policy=self.policy,
                changed=self._replicas_changed,
            )
            self.autoscaler.start()
        for phase in self.scenario.phases:
            at(phase.start_s, partial(self._phase_edge, phase.name, -1))
            at(min(phase.end_s, end), partial(self._phase_edge, phase.name, 1))
        self.timeline.run(end, progress)
        meter = self.replicas.meter
        meter.advance(end)
        return RunResult(
            self.scenario,
            self.policy_name,
            self.seed,
            self.config,
            self.clients.attempts,
            self.samples,
            dict(self.output_tokens),
            self.clients.gave_up,
            replica_seconds=meter.seconds,
            peak_replicas=meter.peak,
            scaling=self.autoscaler.log if self.autoscaler is not None else [],
        )

    # -- the scenario's events ----------------------------------------------------------------

    def _capacity(self, fraction: float) -> None:
        """Every replica keeps `fraction` of its slots and KV (sim/replicas.py, `resize`)."""
        throughput = self.replicas.resize(fraction)
        self.in_flight.evict_all(self.policy.capacity(fraction, throughput, self.timeline.now))

    def _replicas_changed(self) -> None:
        """Replicas were added or drained (the autoscaler): tell the policy, act on it."""
        now = self.timeline.now
        self.in_flight.evict_all(self.policy.set_replicas(len(self.replicas.serving), now))
        if self.policy.holds_requests:
            self.in_flight.dispatch()

    def _phase_edge(self, phase: str, sign: int) -> None:
        """Output tokens of a phase = the engines' cumulative counts at its end minus at its
        start (tokens of a step in progress at an edge count where the step began)."""
        for tag, tokens in self.replicas.output_tokens_by_tag():
            self.output_tokens[(tag, phase)] += sign * tokens

    def _join(self, entitlement: str) -> None:
        self.policy.join(entitlement, self.timeline.now)

    def _leave(self, entitlement: str) -> None:
        self.in_flight.end_all(self.policy.leave(entitlement, self.timeline.now))

    def _tick(self) -> None:
        now = self.timeline.now
        self.in_flight.end_all(self.policy.tick(now))  # leases expired: nobody settled them
        if self.policy.holds_requests:
            self.in_flight.aftermath()
        self.in_flight.suspension.resume()
        self.timeline.at(now + 0.5, self._tick)

    def _sample(self) -> None:
        now, replicas = self.timeline.now, self.replicas
        running = replicas.running_by_tag()
        scores = self.policy.scores(now)
        rejected, low_priority = self.clients.refusals()
        self.samples.append(
            Sample(
                t=now,
                waiting=replicas.scheduled_waiting,
                running=replicas.running,
                slots=replicas.slots,
                kv_usage=replicas.kv_usage,
                running_by_tenant={k: v for k, v in running.items() if v},
                scores=scores,
                rejected_by_tenant=rejected,
                low_priority_by_tenant=low_priority,
            )
        )
        self.timeline.at(now + self.scenario.sample_interval_s, self._sample)


def simulate(
    scenario: Scenario,
    policy: str,
    seed: int | None = None,
    *,
    progress: Callable[[float], None] | None = None,
    profile: EngineProfile | None = None,
) -> RunResult:
    return Simulation(scenario, policy, seed, profile=profile).run(progress)


__all__ = ["RunResult", "Simulation", "simulate"]
