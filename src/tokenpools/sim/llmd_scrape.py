"""What llm-d's endpoint picker knows of the pool, and when: its data layer scrapes each
endpoint's metrics every 50 ms (--refresh-metrics-interval, pkg/epp/server/options.go) and flow
control caches the endpoint list as long (cmd/epp/runner/runner.go). The utilisation detector
and the endpoint picker read that scrape; the concurrency detector reads the picker's own
in-flight counters, which move the moment a request is sent or its stream ends.

A scrape is the pool as it stood at the first read in its 50 ms window, the windows aligned on
the simulated clock (sim/llmd_flow.py reads at each window's start while it holds or has sent
requests, so there the scrape is the pool at that instant).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tokenpools.sim.llmd_parts import (
    SCRAPE_TICKS,
    concurrency_saturation,
    cycle,
    utilization_saturation,
)
from tokenpools.sim.policy import Cluster, EndpointLoad, SimRequest
from tokenpools.sim.scenario import LlmdSpec


@runtime_checkable
class Routable(Protocol):
    """A cluster that sends a request to the replica the picker chose (sim/replicas.py)."""

    @property
    def serving(self) -> list[int]: ...

    def pin(self, req_id: str, replica: int) -> None: ...


class Scrape:
    def __init__(self, cluster: Cluster, spec: LlmdSpec) -> None:
        self.cluster, self.spec = cluster, spec
        self.router = cluster if isinstance(cluster, Routable) else None
        self.window = -1  # the 50 ms window of the last scrape
        self.endpoints: list[EndpointLoad] = []
        self.replicas: list[int] = []  # the replica behind each endpoint scraped
        self._utilization: float | None = None  # of the last scrape, once computed
        self.turn = 0  # rotates the picker's choice among equally loaded endpoints

    def read(self, now: float) -> list[EndpointLoad]:
        """The endpoints as last scraped: scraped anew once a window has begun since."""
        window = cycle(now) // SCRAPE_TICKS
        if window != self.window:
            self.window = window
            self.endpoints = self.cluster.endpoints
            self.replicas = list(self.router.serving) if self.router is not None else []
            self._utilization = None
        return self.endpoints

    def next_window(self, now: float) -> int:
        """The tick on which the next scrape is due."""
        return (cycle(now) // SCRAPE_TICKS + 1) * SCRAPE_TICKS

    def saturation(self, now: float) -> float:
        """The configured detector's reading of the pool (no endpoint: saturated, 1.0)."""
        spec = self.spec
        if spec.detector == "concurrency":
            endpoints = self.cluster.endpoints
            per_endpoint = spec.max_concurrency or max(
                1, self.cluster.slots // max(1, len(endpoints))
            )
            return concurrency_saturation(endpoints, per_endpoint)
        endpoints = self.read(now)
        if self._utilization is None:
            self._utilization = utilization_saturation(
                endpoints, spec.queue_depth_threshold, spec.kv_cache_util_threshold
            )
        return self._utilization

    def pick(self, req: SimRequest, now: float) -> None:
        """Send `req` to the endpoint with the fewest requests running and waiting in the last
        scrape (llm-d's scorers need a prefix cache the engine model lacks: docs/simulation.md);
        equally loaded ones take turns, where llm-d's max-score picker draws at random. A
        cluster that cannot be told routes by itself."""
        endpoints = self.read(now)
        if self.router is None or not endpoints:
            return
        loads = [e.waiting + e.running for e in endpoints]
        low = min(loads)
        tied = [i for i, load in enumerate(loads) if load == low]
        choice = tied[self.turn % len(tied)]
        self.turn += 1
        self.router.pin(req.req_id, self.replicas[choice])
