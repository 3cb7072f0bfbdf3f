"""llm-d's queues in the endpoint picker: one band per priority, one FCFS queue per flow (band,
fairness id) in it, each band bounded in requests and bytes (flowcontrol/registry/config.go),
and the fairness policy that picks a band's next flow.

The bands are every InferenceObjective's priority and band 0, provisioned from the start and
never collected (registry/registry.go: the initial bands and the control plane's desired ones
are protected from garbage collection; registry/config.go always provisions band 0). Which
bands exist matters: the holdback and soft-reflective ceilings are spread over them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tokenpools.sim.llmd_parts import LeastAttainedService
from tokenpools.sim.policy import SimRequest
from tokenpools.sim.scenario import LlmdSpec

BYTES_PER_PROMPT_TOKEN = 4  # a request body's size, for the bands' byte capacity (modelled)


@dataclass(slots=True)
class Queued:
    req: SimRequest
    enqueued_at: float
    size: int


class Bands:
    def __init__(self, declared: Iterable[int], spec: LlmdSpec) -> None:
        self.spec = spec
        self.order = sorted({*declared, 0}, reverse=True)  # priorities, highest first
        # band → flow (fairness id) → FCFS queue
        self.flows: dict[int, dict[str, deque[Queued]]] = {p: {} for p in self.order}
        self.load: dict[int, list[int]] = {p: [0, 0] for p in self.order}  # [requests, bytes]
        self.where: dict[str, tuple[int, str]] = {}  # queued request → (band, flow)
        self.las = LeastAttainedService(
            spec.las_weight_service, spec.las_weight_head_wait, spec.las_half_life_s
        )
        self.cursor: dict[int, str] = {}  # round-robin: the flow served last, per band

    def __len__(self) -> int:
        return len(self.where)

    def band(self, priority: int) -> int:
        """The band a priority is filed under: its own, or band 0 for one no objective
        declares (controller.go, withConnectionWithFallback)."""
        return priority if priority in self.flows else 0

    def add(self, req: SimRequest, priority: int, program: str, now: float) -> bool:
        """File the request under its band and flow; False when the band is at its request or
        byte capacity."""
        size = BYTES_PER_PROMPT_TOKEN * req.prompt_tokens
        load = self.load[priority]
        if load[0] + 1 > self.spec.band_max_requests or load[1] + size > self.spec.band_max_bytes:
            return False
        self.flows[priority].setdefault(program, deque()).append(Queued(req, now, size))
        load[0] += 1
        load[1] += size
        self.where[req.req_id] = (priority, program)
        return True

    def remove(self, req_id: str) -> Queued | None:
        place = self.where.pop(req_id, None)
        if place is None:
            return None
        priority, program = place
        queue = self.flows[priority][program]
        item = queue.popleft() if queue[0].req.req_id == req_id else None
        if item is None:
            item = next(q for q in queue if q.req.req_id == req_id)
            queue.remove(item)
        load = self.load[priority]
        load[0] -= 1
        load[1] -= item.size
        return item

    def waiting(self, priority: int) -> bool:
        return self.load[priority][0] > 0

    def head(self, priority: int, now: float) -> Queued | None:
        """The request the band's fairness policy would dispatch next, if any."""
        if not self.load[priority][0]:
            return None
        heads = {p: q[0].enqueued_at for p, q in self.flows[priority].items() if q}
        if self.spec.fairness == "global-strict":  # the earliest head across the band's flows
            program = min(heads, key=lambda p: (heads[p], p))
        elif self.spec.fairness == "round-robin":  # the next flow after the one served last
            ids = sorted(heads)
            last = self.cursor.get(priority)
            after = [p for p in ids if last is None or p > last]
            program = self.cursor[priority] = (after or ids)[0]
        else:
            program = self.las.pick(heads, now) or min(heads)
        return self.flows[priority][program][0]

    def expire(self, now: float, ttl: float) -> list[SimRequest]:
        """Take out the queued requests that have waited `ttl` seconds or more."""
        late = [
            q.req
            for flows in self.flows.values()
            for queue in flows.values()
            for q in queue
            if now >= q.enqueued_at + ttl
        ]
        for req in late:
            self.remove(req.req_id)
        return late

    def queued(self) -> Mapping[int, int]:
        """Requests waiting per band."""
        return {p: load[0] for p, load in self.load.items()}
