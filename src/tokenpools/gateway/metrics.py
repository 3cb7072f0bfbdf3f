"""What only the gateway adds to the admission metrics (admission/metrics.py): its backends'
health and the requests its HTTP parser refused."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenpools.gateway.backends import BackendPool
from tokenpools.gateway.http_layer import REFUSED


class GatewayCollector(Collector):
    def __init__(self, pools: Callable[[], Mapping[str, BackendPool]]) -> None:
        self.pools = pools  # the gateway's, as they are when scraped (a reload replaces them)

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "tokenpools_backend_healthy",
            "1 while the backend passes its health check",
            labels=["pool", "url"],
        )
        for name, pool in self.pools().items():
            for b in pool.backends:
                healthy.add_metric([name, b.spec.url], float(b.healthy))
        refused = CounterMetricFamily(
            "tokenpools_http_refused",
            "Requests the HTTP parser could not read (framing, headers, method), by code",
            labels=["code"],
        )
        for code, count in sorted(REFUSED.counts.items()):
            refused.add_metric([code], count)
        yield from (healthy, refused)
