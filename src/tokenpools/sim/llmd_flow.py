"""llm-d's flow control as a simulator policy (`llm-d`): what a Kubernetes platform would run
instead of tokenpools in 2026, with llm-d's `flowControl` feature gate on. Requests wait in the
endpoint picker, one queue per flow (band, fairness id); a dispatch cycle walks the bands from
the highest priority down and releases one request from the first band with work, chosen
between its flows by the fairness policy, unless the pool's saturation has reached that band's
usage-limit ceiling — then the cycle stops (head-of-line blocking, so lower bands never add to
the saturation that holds a higher one back) and, with eviction on, sheddable requests in
flight are revoked for the blocked band. Queued requests time out after the request TTL; a full
band refuses new ones. Neither answer carries Retry-After.

A cycle runs on each arrival and on each tick of a 1 ms ticker, none on completions
(controller/internal/processor.go, Run). Ticks whose cycle could change nothing — blocked, and
nothing it reads has moved — are not run one by one: they are counted when the next cycle runs,
and the policy asks to be woken for the first tick that could differ (sim/policy.py,
`Aftermath.wake_at`).

The pieces are sim/llmd_parts.py, llmd_queues.py and llmd_scrape.py; docs/simulation.md says
which parts follow llm-d's code and which are modelled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tokenpools.model.config import Config, ConfigError
from tokenpools.model.objectives import PRIORITY
from tokenpools.model.service_class import ServiceClass
from tokenpools.sim.llmd_parts import (
    CYCLE_S,
    SoftReflectiveCeiling,
    confirmation_grace,
    cycle,
    holdback_ceilings,
    revocations,
    static_ceilings,
)
from tokenpools.sim.llmd_queues import Bands
from tokenpools.sim.llmd_scrape import Scrape
from tokenpools.sim.policy import (
    AdmissionPolicy,
    Aftermath,
    Cluster,
    Queue,
    Refuse,
    SimRequest,
    Verdict,
)
from tokenpools.sim.scenario import LlmdSpec

SWEEP_S = 1.0  # expiryCleanupInterval: queued requests are checked for their TTL this often


@dataclass(slots=True)
class _InFlight:
    req: SimRequest
    priority: int
    dispatched_at: float


def band_priorities(spec: LlmdSpec) -> dict[ServiceClass, int]:
    """Service class → llm-d band: the objectives tokenpools emits, or the scenario's own."""
    if spec.priorities is None:
        return dict(PRIORITY)
    try:
        given = {ServiceClass(k): v for k, v in spec.priorities.items()}
    except ValueError as exc:
        raise ConfigError(f"llmd.priorities: {exc}") from None
    return {c: given.get(c, PRIORITY[c]) for c in ServiceClass}


class LlmdFlowControl(AdmissionPolicy):
    name = "llm-d"
    holds_requests = True

    def __init__(self, config: Config, cluster: Cluster, spec: LlmdSpec | None = None) -> None:
        self.spec = spec = spec or LlmdSpec()
        classes = band_priorities(spec)
        self.band_of = {n: classes[e.service_class] for n, e in config.entitlements.items()}
        self.program_of = {n: e.tenant_id for n, e in config.entitlements.items()}
        self.queues = Bands(classes.values(), spec)
        self.scrape = Scrape(cluster, spec)
        self.in_flight: dict[str, _InFlight] = {}
        order = self.queues.order
        self.fixed_ceilings = (  # the bands never change, so neither do these ceilings
            holdback_ceilings(order, spec.min_ceiling, spec.max_ceiling, spec.domain)
            if spec.usage_limit == "priority-holdback"
            else static_ceilings(len(order), spec.threshold)
        )
        self.soft = SoftReflectiveCeiling()
        self.grace_s = (
            confirmation_grace(spec.detector)
            if spec.confirmation_grace_s is None
            else spec.confirmation_grace_s
        )
        self.gate_opens_at = 0.0  # in-flight eviction: the next decision waits for this
        self.next_sweep = SWEEP_S
        self.pending = Aftermath()
        # the dispatch cycles: one owed per arrival; ticks up to `ticked` are accounted for
        self.owed = 0
        self.ticked = -1
        self.blocked = False  # the last cycle stopped at a band's ceiling
        self.moved = False  # since then, what the concurrency detector reads has moved
        self.saturation = 0.0  # what the last cycle read

    # -- admission: into a queue, or 429 when the band is full --------------------------------

    def admit(self, req: SimRequest, now: float) -> Verdict:
        refused = self.enqueue(
            req, self.band_of[req.entitlement], self.program_of[req.entitlement], now
        )
        return refused or Queue()

    def enqueue(self, req: SimRequest, priority: int, program: str, now: float) -> Refuse | None:
        """File the request under its band and flow; a band at its request or byte capacity
        refuses it (429 `queue at capacity`, no Retry-After). Either way a cycle follows."""
        self.owed += 1
        if not self.queues:  # the ticks since the queue emptied had nothing to do
            self.ticked = max(self.ticked, math.ceil(now / CYCLE_S - 1e-6) - 1)
        if not self.queues.add(req, self.queues.band(priority), program, now):
            return Refuse("queue_full")
        return None

    # -- the dispatch cycles ---------------------------------------------------------------------

    def dispatch(self, now: float, free_slots: int) -> list[SimRequest]:
        """The cycles due by `now`: the tick's if one falls on this instant, then one per
        arrival since the last call. Returns the first request one of them releases (the host
        sends it and calls again, so the next cycle reads the pool with it sent)."""
        self.scrape.read(now)  # a window that began since is scraped at its start
        due = cycle(now)
        if due > self.ticked:
            on_tick = now - due * CYCLE_S < 1e-9
            self._skipped(due - self.ticked - int(on_tick))
            self.ticked = due
            if on_tick and (released := self._cycle(now)):
                return [released]
        while self.owed:
            self.owed -= 1
            if released := self._cycle(now):
                return [released]
        return []

    def _skipped(self, ticks: int) -> None:
        """Ticks not run since the last cycle while requests waited: each would have been
        blocked on what that cycle read, and would have moved the soft ceiling's tick."""
        if ticks > 0 and self.queues and self.spec.usage_limit == "soft-reflective-ceiling":
            self.soft.advance(self.saturation, len(self.queues.order), ticks)

    def ceilings(self, saturation: float) -> list[float]:
        if self.spec.usage_limit == "soft-reflective-ceiling":
            return self.soft.ceilings(saturation, len(self.queues.order))
        return self.fixed_ceilings

    def _cycle(self, now: float) -> SimRequest | None:
        """One cycle (processor.go, dispatchCycle): bands from the highest down; the first at
        or past its ceiling stops the cycle, whether or not it has work; else the first with
        work releases its fairness pick."""
        self.saturation = saturation = self.scrape.saturation(now)
        self.moved = False
        ceilings = self.ceilings(saturation)
        for i, priority in enumerate(self.queues.order):
            if saturation >= ceilings[i]:
                self.blocked = True
                if self.spec.eviction:
                    self._reclaim(saturation, ceilings, i, now)
                return None
            item = self.queues.head(priority, now)
            if item is None:
                continue
            req = item.req
            self.queues.remove(req.req_id)
            self.in_flight[req.req_id] = _InFlight(req, priority, now)
            self.scrape.pick(req, now)
            if self.spec.propagate_priority:  # vLLM serves lower values first
                req.priority = -priority
            self.blocked = False
            return req
        self.blocked = False
        return None

    def _next_cycle(self, now: float) -> float | None:
        """When a tick's cycle could next do something: the next tick after a release (or
        after the concurrency detector's reading moved); after a block, the first of the next
        scrape, the tick the soft ceiling opens and the tick the reclamation gate opens. With
        nothing queued, the next scrape while requests are in flight (so that it is taken at
        its window's start), else none."""
        if not self.queues:
            return self.scrape.next_window(now) * CYCLE_S if self.in_flight else None
        tick = self.ticked + 1
        if self.blocked and not self.moved:
            ticks = [self.scrape.next_window(now)]
            if self.spec.usage_limit == "soft-reflective-ceiling":
                calls = self.soft.calls_to_open(self.saturation)
                if calls is not None:
                    ticks.append(self.ticked + calls)
            if self.spec.eviction and not self._gate_open(now):
                ticks.append(math.ceil(self.gate_opens_at / CYCLE_S - 1e-6))
            tick = max(min(ticks), tick)
        return max(tick * CYCLE_S, now)  # a tick passed without a call runs at once

    def _reclaim(self, saturation: float, ceilings: list[float], at: int, now: float) -> None:
        """Revoke sheddable requests in flight for the highest blocked band with queued work
        above the next victim's priority (controller/internal/reclamation.go, maybeReclaim and
        Reclaim), unless the last revocations are still within their confirmation grace."""
        if not self._gate_open(now):
            return
        victims = self._victims()
        if not victims:
            return
        order = self.queues.order
        victim_priority = victims[0].priority
        for j in range(at, len(order)):
            if order[j] <= victim_priority:
                return
            if ceilings[j] <= 0 or saturation < ceilings[j] or not self.queues.waiting(order[j]):
                continue
            n = revocations(
                saturation,
                ceilings[j],
                len(self.in_flight),
                len(victims),
                self.spec.max_revocations,
            )
            chosen = [v for v in victims[:n] if v.priority < order[j]]
            for v in chosen:
                del self.in_flight[v.req.req_id]
                self.pending.evict.append(v.req.req_id)
            if chosen:
                # The stream ends at once here, so confirmation is immediate; the grace covers
                # the time until the detector can see the room made.
                self.gate_opens_at = now + self.grace_s
            return

    def _gate_open(self, now: float) -> bool:
        return now >= self.gate_opens_at - 1e-9  # float sums land a hair either side of it

    def _victims(self) -> list[_InFlight]:
        """Sheddable requests in flight (priority < 0), lowest priority first, then the most
        recently dispatched (the least KV invested): llm-d's eviction filter and ordering."""
        shed = [f for f in self.in_flight.values() if f.priority < 0]
        return sorted(shed, key=lambda f: (f.priority, -f.dispatched_at, f.req.req_id))

    # -- endings and time ------------------------------------------------------------------------

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        self._ended(req)
        self.queues.las.completed(
            self.program_of[req.entitlement], req.prompt_tokens, output_tokens, now
        )

    def ended_early(self, req: SimRequest, now: float) -> None:
        self._ended(req)
        self.queues.remove(req.req_id)

    def _ended(self, req: SimRequest) -> None:
        if self.in_flight.pop(req.req_id, None) is not None and self.spec.detector == "concurrency":
            self.moved = True  # its counters drop at once: the next tick may release

    def tick(self, now: float) -> list[str]:
        if now >= self.next_sweep:
            self.next_sweep = now + SWEEP_S
            self.pending.refuse += [(r.req_id, "queue_timeout") for r in self.expire(now)]
        return []

    def expire(self, now: float) -> list[SimRequest]:
        """Queued requests past the TTL leave the queue (429 when the pool has endpoints, as
        here; 503 only for an empty pool)."""
        ttl = self.spec.request_ttl_s
        return self.queues.expire(now, ttl) if ttl > 0 else []

    def aftermath(self, now: float) -> Aftermath:
        out, self.pending = self.pending, Aftermath()
        out.wake_at = self._next_cycle(now)
        return out

    def queued(self) -> Mapping[int, int]:
        """Requests waiting per band (for tests and samples)."""
        return self.queues.queued()
