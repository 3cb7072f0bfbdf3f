"""The operator's Prometheus metrics, in a registry of its own (`/metrics` on the probe port)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge


class OperatorMetrics:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(
            "tokenpools_operator_reconciles", "objects reconciled", ["kind", "result"], registry=r
        )
        self.errors = Counter(
            "tokenpools_operator_errors",
            "failed reconciliations and heartbeats, by object kind and API error",
            ["kind", "reason"],
            registry=r,
        )
        self.heartbeat_age = Gauge(
            "tokenpools_operator_node_heartbeat_age_seconds",
            "seconds since each virtual node's heartbeat last succeeded",
            ["node"],
            registry=r,
        )
        self.lease_pods = Gauge(
            "tokenpools_operator_entitlements", "entitlements by state", ["state"], registry=r
        )
        self.desired = Gauge(
            "tokenpools_pool_desired_replicas",
            "replicas each pool's entitlements need (for HPA or KEDA in publish mode)",
            ["pool"],
            registry=r,
        )
        self.scale_writes = Counter(
            "tokenpools_operator_scale_writes", "writes of a workload's /scale", ["pool"],
            registry=r,
        )  # fmt: skip
        self._beats: dict[str, float] = {}

    def beat(self, node: str) -> None:
        if node not in self._beats:
            self.heartbeat_age.labels(node).set_function(lambda: self.clock() - self._beats[node])
        self._beats[node] = self.clock()

    def forget(self, node: str) -> None:
        if self._beats.pop(node, None) is not None:
            self.heartbeat_age.remove(node)
