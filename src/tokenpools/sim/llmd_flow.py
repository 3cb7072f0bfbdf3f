"""llm-d's flow control as a simulator policy (`llm-d`): what a Kubernetes platform would run
instead of tokenpools in 2026. Requests wait in the endpoint picker, one queue per flow (band,
fairness id); a dispatch cycle walks the bands from the highest priority down and releases one
request from the first band with work, chosen between its flows by the fairness policy, unless the
pool's saturation has reached that band's usage-limit ceiling — then the cycle stops (head-of-line
blocking, so lower bands never add to the saturation that holds a higher one back) and, with
eviction on, sheddable requests in flight are revoked for the blocked band. Queued requests time
out after the request TTL; a full band refuses new ones. Neither answer carries Retry-After.

The pieces are sim/llmd_parts.py; docs/simulation.md says which parts follow llm-d's code and
which are modelled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from tokenpools.model.config import Config, ConfigError
from tokenpools.model.objectives import PRIORITY
from tokenpools.model.service_class import ServiceClass
from tokenpools.sim.llmd_parts import (
    CYCLE_S,
    LeastAttainedService,
    SoftReflectiveCeiling,
    concurrency_saturation,
    cycle,
    holdback_ceilings,
    revocations,
    static_ceilings,
    utilization_saturation,
)
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

BYTES_PER_PROMPT_TOKEN = 4  # a request body's size, for the bands' byte capacity (modelled)
SWEEP_S = 1.0  # expiryCleanupInterval: queued requests are checked for their TTL this often


@dataclass(slots=True)
class _Queued:
    req: SimRequest
    enqueued_at: float
    size: int


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
        self.spec = spec or LlmdSpec()
        self.cluster = cluster
        classes = band_priorities(self.spec)
        self.band_of = {n: classes[e.service_class] for n, e in config.entitlements.items()}
        self.program_of = {n: e.tenant_id for n, e in config.entitlements.items()}
        # bands by priority → flows by fairness id → FCFS queue
        self.bands: dict[int, dict[str, deque[_Queued]]] = {}
        self.band_load: dict[int, list[int]] = {}  # priority → [requests, bytes] queued
        self.where: dict[str, tuple[int, str]] = {}  # queued request → (band, flow)
        self.in_flight: dict[str, _InFlight] = {}
        self.las = LeastAttainedService(
            self.spec.las_weight_service, self.spec.las_weight_head_wait, self.spec.las_half_life_s
        )
        self.cursor: dict[int, str] = {}  # round-robin: the flow served last, per band
        self.soft = SoftReflectiveCeiling()
        self.gate_opens_at = 0.0  # in-flight eviction: the next decision waits for this
        self.next_sweep = SWEEP_S
        self.pending = Aftermath()

    # -- admission: into a queue, or 429 when the band is full --------------------------------

    def admit(self, req: SimRequest, now: float) -> Verdict:
        refused = self.enqueue(
            req, self.band_of[req.entitlement], self.program_of[req.entitlement], now
        )
        return refused or Queue()

    def enqueue(self, req: SimRequest, priority: int, program: str, now: float) -> Refuse | None:
        """File the request under its band and flow; a band at its request or byte capacity
        refuses it (429 `queue at capacity`, no Retry-After)."""
        size = BYTES_PER_PROMPT_TOKEN * req.prompt_tokens
        load = self.band_load.setdefault(priority, [0, 0])
        if load[0] + 1 > self.spec.band_max_requests or load[1] + size > self.spec.band_max_bytes:
            return Refuse("queue_full")
        self.bands.setdefault(priority, {}).setdefault(program, deque()).append(
            _Queued(req, now, size)
        )
        load[0] += 1
        load[1] += size
        self.where[req.req_id] = (priority, program)
        return None

    def _remove(self, req_id: str) -> _Queued | None:
        place = self.where.pop(req_id, None)
        if place is None:
            return None
        priority, program = place
        queue = self.bands[priority][program]
        item = next(q for q in queue if q.req.req_id == req_id)
        queue.remove(item)
        load = self.band_load[priority]
        load[0] -= 1
        load[1] -= item.size
        return item

    # -- the dispatch cycle ----------------------------------------------------------------------

    def saturation(self) -> float:
        endpoints = self.cluster.endpoints
        if self.spec.detector == "concurrency":
            per_endpoint = self.spec.max_concurrency or max(
                1, self.cluster.slots // max(1, len(endpoints))
            )
            return concurrency_saturation(endpoints, per_endpoint)
        return utilization_saturation(
            endpoints, self.spec.queue_depth_threshold, self.spec.kv_cache_util_threshold
        )

    def ceilings(self, saturation: float, priorities: list[int], now: float) -> list[float]:
        spec = self.spec
        if spec.usage_limit == "priority-holdback":
            return holdback_ceilings(priorities, spec.min_ceiling, spec.max_ceiling, spec.domain)
        if spec.usage_limit == "soft-reflective-ceiling":
            return self.soft.ceilings(saturation, len(priorities), now)
        return static_ceilings(len(priorities), spec.threshold)

    def dispatch(self, now: float, free_slots: int) -> list[SimRequest]:
        """One dispatch cycle: at most one request, as llm-d's processor releases per cycle (the
        host calls again until none comes, as its 1 ms ticker would)."""
        if not self.where:
            return []
        # Every band seen so far is active (llm-d collects an idle band after 10 minutes).
        priorities = sorted(self.bands, reverse=True)
        saturation = self.saturation()
        ceilings = self.ceilings(saturation, priorities, now)
        for i, priority in enumerate(priorities):
            if saturation >= ceilings[i]:
                self._blocked(saturation, priorities, ceilings, i, now)
                return []
            program = self._pick(priority, now)
            if program is None:
                continue
            item = self.bands[priority][program][0]
            self._remove(item.req.req_id)
            self.in_flight[item.req.req_id] = _InFlight(item.req, priority, now)
            return [item.req]
        return []

    def _pick(self, priority: int, now: float) -> str | None:
        flows = {p: q[0].enqueued_at for p, q in self.bands[priority].items() if q}
        if not flows:
            return None
        if self.spec.fairness == "global-strict":  # the earliest head across the band's flows
            return min(flows, key=lambda p: (flows[p], p))
        if self.spec.fairness == "round-robin":  # the next flow after the one served last
            ids = sorted(flows)
            last = self.cursor.get(priority)
            after = [p for p in ids if last is None or p > last]
            chosen = (after or ids)[0]
            self.cursor[priority] = chosen
            return chosen
        return self.las.pick(flows, now)

    def _blocked(
        self, saturation: float, priorities: list[int], ceilings: list[float], at: int, now: float
    ) -> None:
        """A band is held back. Soft ceilings reopen on a later cycle by themselves: ask for it.
        With eviction on, revoke sheddable requests in flight for the highest blocked band with
        queued work above the next victim's priority (reclamation.go's trigger and sizing)."""
        waiting = any(self.bands[p][f] for p in priorities[at:] for f in self.bands[p])
        if self.spec.usage_limit == "soft-reflective-ceiling" and waiting and saturation < 1.0:
            self.pending.wake_at = (cycle(now) + 1) * CYCLE_S  # the next cycle's start
        if not self.spec.eviction or not waiting:
            return
        if now < self.gate_opens_at:  # the last revocations have not shown in the gauge yet
            self.pending.wake_at = self.gate_opens_at
            return
        victims = self._victims()
        if not victims:
            return
        victim_priority = victims[0].priority
        for j in range(at, len(priorities)):
            if priorities[j] <= victim_priority:
                return
            if ceilings[j] <= 0 or saturation < ceilings[j]:
                continue
            if not any(self.bands[priorities[j]].values()):
                continue
            n = revocations(
                saturation,
                ceilings[j],
                len(self.in_flight),
                len(victims),
                self.spec.max_revocations,
            )
            chosen = [v for v in victims[:n] if v.priority < priorities[j]]
            for v in chosen:
                del self.in_flight[v.req.req_id]
                self.pending.evict.append(v.req.req_id)
            if chosen:
                # The stream ends at once here, so confirmation is immediate; the grace covers
                # the engine's abort and the next scrape before the gauge shows the room made.
                self.gate_opens_at = now + self.spec.confirmation_grace_s
            return

    def _victims(self) -> list[_InFlight]:
        """Sheddable requests in flight (priority < 0), lowest priority first, then the most
        recently dispatched (the least KV invested): llm-d's eviction filter and ordering."""
        shed = [f for f in self.in_flight.values() if f.priority < 0]
        return sorted(shed, key=lambda f: (f.priority, -f.dispatched_at, f.req.req_id))

    # -- endings and time ------------------------------------------------------------------------

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        self.in_flight.pop(req.req_id, None)
        self.las.completed(self.program_of[req.entitlement], req.prompt_tokens, output_tokens, now)

    def ended_early(self, req: SimRequest, now: float) -> None:
        self.in_flight.pop(req.req_id, None)
        self._remove(req.req_id)

    def tick(self, now: float) -> list[str]:
        if now >= self.next_sweep:
            self.next_sweep = now + SWEEP_S
            self.pending.refuse += [(r.req_id, "queue_timeout") for r in self.expire(now)]
        return []

    def expire(self, now: float) -> list[SimRequest]:
        """Queued requests past the TTL leave the queue (429 when the pool has endpoints, as
        here; 503 only for an empty pool)."""
        ttl = self.spec.request_ttl_s
        if ttl <= 0:
            return []
        late = [
            q.req
            for flows in self.bands.values()
            for queue in flows.values()
            for q in queue
            if now >= q.enqueued_at + ttl
        ]
        for req in late:
            self._remove(req.req_id)
        return late

    def aftermath(self, now: float) -> Aftermath:
        out, self.pending = self.pending, Aftermath()
        return out

    def queued(self) -> Mapping[int, int]:
        """Requests waiting per band (for tests and samples)."""
        return {p: load[0] for p, load in self.band_load.items()}
