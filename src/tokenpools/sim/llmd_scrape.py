"""What llm-d's endpoint picker knows of the pool, and when: its data layer scrapes each
endpoint's metrics on that endpoint's own 50 ms ticker (--refresh-metrics-interval,
pkg/epp/server/options.go), started when the endpoint joins the datastore
(pkg/epp/datalayer/runtime.go, `NewEndpoint`: one `Collector` and `NewTimeTicker` per endpoint;
collector.go, `runPolling`), and flow control caches the endpoint list as long
(cmd/epp/runner/runner.go). The utilisation detector and the endpoint picker read each
endpoint's last scrape; the concurrency detector reads the picker's own in-flight counters,
which move the moment a request is sent or its stream ends.

Each endpoint's reading is the engine as it stood at the first read on or after its scrape
tick. The scrape ticks are a pure function of simulated time: the n endpoints serving from the
start are scraped at ticks i·50/n (mod 50), their phases spread evenly, and an endpoint that
joins later is scraped first on the tick it is first seen serving, then every 50 ticks from
there. sim/llmd_flow.py reads at the next scrape of any endpoint while it holds or has sent
requests, so there each reading is its engine at its scrape tick.
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

    def endpoint(self, replica: int) -> EndpointLoad: ...

    def pin(self, req_id: str, replica: int) -> None: ...


def _next_scrape(phase: int, tick: int) -> int:
    """The first tick after `tick` on which an endpoint scraped at `phase` (mod 50) is."""
    return tick + (phase - tick - 1) % SCRAPE_TICKS + 1


class Scrape:
    def __init__(self, cluster: Cluster, spec: LlmdSpec) -> None:
        self.cluster, self.spec = cluster, spec
        self.router = cluster if isinstance(cluster, Routable) else None
        self.endpoints: list[EndpointLoad] = []  # each endpoint's last reading
        self.replicas: list[int] = []  # the replica behind each endpoint, serving order
        self._seen: object = None  # the serving list last compared (Replicas replaces it)
        initial = self._serving()
        n = max(1, len(initial))
        self._phase = {r: (i * SCRAPE_TICKS) // n for i, r in enumerate(initial)}
        self._next: dict[int, int] = {}  # replica → the tick of its next scrape
        self._reading: dict[int, EndpointLoad] = {}  # replica → its last scrape
        self.due = 0  # the earliest of them: before it, a read changes nothing
        self._utilization: float | None = None  # of the readings, once computed
        self.turn = 0  # rotates the picker's choice among equally loaded endpoints

    def _serving(self) -> list[int]:
        if self.router is not None:
            return list(self.router.serving)
        return list(range(len(self.cluster.endpoints)))

    def _live(self, replica: int) -> EndpointLoad:
        if self.router is not None:
            return self.router.endpoint(replica)
        return self.cluster.endpoints[replica]

    def read(self, now: float) -> list[EndpointLoad]:
        """Each endpoint's last reading: those whose scrape tick has come since are read
        anew. Between scrapes (and membership changes) this is one comparison."""
        tick = cycle(now)
        serving = self.router.serving if self.router is not None else None
        if tick < self.due and (serving is None or serving is self._seen):
            return self.endpoints
        self._seen = serving
        current = self._serving()
        changed = current != self.replicas
        if changed:  # endpoints joined or left: a newcomer is read now, its ticker started
            for r in current:
                if r not in self._next:
                    phase = self._phase.setdefault(r, tick % SCRAPE_TICKS)
                    self._reading[r] = self._live(r)
                    self._next[r] = _next_scrape(phase, tick)
            self.replicas = current
        for r in current:
            if self._next[r] <= tick:
                self._reading[r] = self._live(r)
                self._next[r] = _next_scrape(self._phase[r], tick)
                changed = True
        if changed:
            self.endpoints = [self._reading[r] for r in current]
            self._utilization = None
        self.due = min((self._next[r] for r in current), default=tick + SCRAPE_TICKS)
        return self.endpoints

    def next_window(self, now: float) -> int:
        """The tick on which the next scrape of any endpoint is due."""
        self.read(now)
        return self.due

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
        """Send `req` to the endpoint with the fewest requests running and waiting in its last
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
