"""The pool's replicas: one engine each, which of them serve, and what they cost.

A replica serves (takes new requests), drains (takes none; released once empty) or is released.
Policies read the serving ones through the `Cluster` interface (sim/policy.py); the simulator
routes requests to them and steps their engines; the autoscaler adds and drains them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from tokenpools.engine.model import Engine, StepResult
from tokenpools.engine.profile import EngineProfile
from tokenpools.engine.queues import SchedulingPolicy
from tokenpools.sim.policy import EndpointLoad, SimRequest


@dataclass(frozen=True, slots=True)
class Aborted:
    """What an aborted request had done on its replica: output tokens generated, and prompt
    tokens prefilled (not served from the prefix cache)."""

    generated: int
    prefilled: int


class ReplicaMeter:
    """Replica-seconds: the integral of replicas provisioned (serving, starting or
    draining) over time, and the largest count."""

    def __init__(self, replicas: int, now: float) -> None:
        self.provisioned = self.peak = replicas
        self.seconds = 0.0
        self._t = now

    def change(self, delta: int, now: float) -> None:
        self.advance(now)
        self.provisioned += delta
        self.peak = max(self.peak, self.provisioned)

    def advance(self, now: float) -> None:
        self.seconds += self.provisioned * (now - self._t)
        self._t = now


class Replicas:
    def __init__(
        self, profile: EngineProfile, count: int, scheduling_policy: SchedulingPolicy = "fcfs"
    ) -> None:
        self.profile = profile
        self.scheduling_policy = scheduling_policy  # every engine's (vLLM's --scheduling-policy)
        self.engines = [Engine(profile, scheduling_policy) for _ in range(count)]
        self.busy = [False] * count  # a step is under way: its end is on the timeline
        self.serving = list(range(count))  # replicas that take new requests, in index order
        self.draining: set[int] = set()  # take no new requests; released when empty
        self.released: set[int] = set()
        self.fraction = 1.0  # of each replica's slots and KV (capacity events)
        self.meter = ReplicaMeter(count, 0.0)
        self._where: dict[str, int] = {}  # request id → the replica it was routed to
        self._pinned: dict[str, int] = {}  # request id → the replica a policy's picker chose
        # Aborts asked for during a replica's step: vLLM frees an aborted request's slot and
        # blocks when the step under way ends (its engine core loop handles aborts between
        # steps), so the room an abort makes comes one step later.
        self._aborting: dict[int, list[str]] = {}

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
        return [self.endpoint(i) for i in self.serving]

    def endpoint(self, replica: int) -> EndpointLoad:
        """One replica as a picker reads it (llm-d scrapes each on its own timer)."""
        e = self.engines[replica]
        return EndpointLoad(e.num_waiting, e.num_running, e.profile.max_num_seqs, e.kv_usage)

    # -- what samples and phases record -------------------------------------------------------

    @property
    def scheduled_waiting(self) -> int:
        """Requests the engines' last schedules left waiting (what vLLM reports)."""
        return sum(e.scheduled_waiting for e in self.engines)

    def running_by_tag(self) -> Counter[str]:
        running: Counter[str] = Counter()
        for engine in self.engines:
            running.update(engine.running_by_tag)
        return running

    def output_tokens_by_tag(self) -> Iterator[tuple[str, int]]:
        """(tag, output tokens so far) of every engine, released ones too, engine by engine."""
        for engine in self.engines:
            yield from engine.output_tokens_by_tag().items()

    # -- requests -------------------------------------------------------------------------

    def pin(self, req_id: str, replica: int) -> None:
        """A policy's endpoint picker chose the replica for this request (`route` honours it
        while that replica serves)."""
        self._pinned[req_id] = replica

    def route(self, req: SimRequest) -> int:
        """Hand a request to the replica pinned for it, else to the serving replica with the
        fewest requests (the lowest index among equals); returns that replica."""
        index = self._pinned.pop(req.req_id, None) if self._pinned else None
        if index is None or index in self.draining or index in self.released:
            index = min(self.serving, key=lambda i: (self._load(i), i))
        # a fcfs engine refuses any priority but 0 (as vLLM says it does): only a priority
        # engine is sent the request's
        priority = req.priority if self.scheduling_policy == "priority" else 0
        self.engines[index].add(
            req.req_id, req.prompt_tokens, req.output_tokens, req.tenant, priority, req.continues
        )
        self._where[req.req_id] = index
        return index

    def _load(self, index: int) -> int:
        """Requests on a replica, those it is aborting not counted (the router closed their
        connections: it knows they are going)."""
        engine = self.engines[index]
        return engine.num_running + engine.num_waiting - len(self._aborting.get(index, ()))

    def finished(self, req_id: str) -> None:
        """A request's engine reported it finished: it is no longer on a replica."""
        self._where.pop(req_id, None)

    def where(self, req_id: str) -> int | None:
        """The replica a request is on (None: none)."""
        return self._where.get(req_id)

    def abort(self, req_id: str) -> Aborted:
        """Take a request off its replica: at once if the replica is between steps, else when
        its step ends. Returns what it had done (nothing when no replica holds it)."""
        index = self._where.pop(req_id, None)
        if index is None:
            return Aborted(0, 0)
        engine = self.engines[index]
        seq = engine.sequence(req_id)
        generated = engine.generated(req_id)
        started = seq is not None and (generated > 0 or seq.computed > 0 or seq.base_step >= 0)
        prefilled = seq.prompt_tokens - seq.cached if seq is not None and started else 0
        if self.busy[index]:
            self._aborting.setdefault(index, []).append(req_id)
        else:
            engine.abort(req_id)
        return Aborted(generated, prefilled)

    def step(self, index: int, now: float) -> StepResult | None:
        """Start a replica's next engine step; None when it has no work (it is idle then, and
        released if it was draining). The caller schedules the step's end."""
        engine = self.engines[index]
        for req_id in self._aborting.pop(index, ()):
            engine.abort(req_id)  # a no-op if it finished in the step that just ended
        if not engine.has_work:
            self.busy[index] = False
            if index in self.draining:
                self.release(index, now)
            return None
        self.busy[index] = True
        return engine.step()

    # -- capacity and replica count -------------------------------------------------------

    def resize(self, fraction: float) -> float:
        """Every replica keeps `fraction` of its slots and KV. Its token throughput does not
        scale the same way (a step has a fixed cost): returns the share of its throughput a
        replica keeps, as the profile says the smaller batch delivers — what an operator would
        re-measure."""
        self.fraction = fraction
        seqs, blocks = self.profile.limits_at(fraction)
        for engine in self.engines:
            engine.resize(seqs, blocks)
        smaller = self.profile.model_copy(update={"max_num_seqs": seqs})
        return smaller.output_tokens_per_s() / self.profile.output_tokens_per_s()

    def ask(self, now: float) -> None:
        """A replica is asked for: it costs replica-seconds from now, before it serves."""
        self.meter.change(+1, now)

    def add(self) -> None:
        """A replica asked for serves (its cold start is over), at the pool's capacity."""
        engine = Engine(self.profile, self.scheduling_policy)
        if self.fraction != 1.0:
            engine.resize(*self.profile.limits_at(self.fraction))
        self.engines.append(engine)
        self.busy.append(False)
        self._count_serving()

    def drain(self, index: int) -> None:
        """A replica stops taking requests; `step` releases it once it is empty."""
        self.draining.add(index)
        self._count_serving()

    def release_if_idle(self, index: int, now: float) -> None:
        if not self.busy[index] and not self.engines[index].has_work:
            self.release(index, now)

    def release(self, index: int, now: float) -> None:
        """A drained replica is empty: it goes back (and stops costing replica-seconds)."""
        self.draining.discard(index)
        self.released.add(index)
        self.meter.change(-1, now)

    def _count_serving(self) -> None:
        gone = self.draining | self.released
        self.serving = [i for i in range(len(self.engines)) if i not in gone]
