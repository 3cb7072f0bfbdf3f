"""Prometheus metrics (prefix `tokenpools_`, labels pool, entitlement, class): counters
bumped per decision, gauges read from the core when scraped (so the admission path pays for
no gauge updates)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.store import StoreUnavailable

if TYPE_CHECKING:
    from tokenpools.gateway.runtime import Gateway

LABELS = ["pool", "entitlement", "class"]


class GatewayMetrics:
    def __init__(self, gateway: Gateway) -> None:
        self.registry = CollectorRegistry()
        self.admitted = Counter(
            "tokenpools_admitted", "Requests admitted", LABELS, registry=self.registry
        )
        self.rejected = Counter(
            "tokenpools_rejected", "Requests rejected", [*LABELS, "reason"], registry=self.registry
        )
        self.evicted = Counter(
            "tokenpools_evicted", "In-flight requests evicted", LABELS, registry=self.registry
        )
        self.unauthorized = Counter(
            "tokenpools_unauthorized", "Requests with an unknown key", registry=self.registry
        )
        self.registry.register(_StateCollector(gateway))
        self._gateway = gateway

    def decided(self, entitlement: str, decision: Decision) -> None:
        ent = self._gateway.core.entitlements[entitlement].ent
        labels = (ent.pool, entitlement, ent.service_class.value)
        if isinstance(decision, Admit):
            self.admitted.labels(*labels).inc()
            for victim in decision.evict:
                v = self._gateway.core.entitlements[victim.entitlement].ent
                self.evicted.labels(v.pool, victim.entitlement, v.service_class.value).inc()
        else:
            self.rejected.labels(*labels, decision.reason.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator[Metric]:
        gw = self.gateway
        now = gw.clock()
        families = {
            name: GaugeMetricFamily(f"tokenpools_{name}", doc, labels=labels)
            for name, doc, labels in (
                ("in_flight", "Requests in flight", LABELS),
                ("reserved", "Reserved by in-flight requests", [*LABELS, "dimension"]),
                ("used", "Observed usage over the last update period", [*LABELS, "dimension"]),
                ("debt", "Debt (Eq. 2)", LABELS),
                ("burst", "Burst (Eq. 3)", LABELS),
                ("priority", "Priority (Eq. 1)", LABELS),
                ("pool_capacity", "Pool capacity", ["pool", "dimension"]),
                ("pool_reserved", "Pool reserved", ["pool", "dimension"]),
            )
        }
        up = GaugeMetricFamily("tokenpools_store_up", "1 while the state store answers")
        fallback = GaugeMetricFamily(
            "tokenpools_fallback_in_flight",
            "Requests admitted on this replica's local budget while the store was unreachable",
        )
        fallback.add_metric([], len(gw.core.fallback.leases))
        try:
            self._collect_state(families, now)
            up.add_metric([], 1)
        except StoreUnavailable:
            up.add_metric([], 0)
        yield from (*families.values(), up, fallback)

    def _collect_state(self, families: dict[str, GaugeMetricFamily], now: float) -> None:
        gw = self.gateway
        for name, view in gw.core.entitlements.items():
            labels = [view.ent.pool, name, view.ent.service_class.value]
            c = gw.core.store.entitlement_counters(name, now)
            scores = gw.core.store.scores(name, now)
            families["in_flight"].add_metric(labels, c.leases)
            families["reserved"].add_metric([*labels, "concurrency"], c.concurrency)
            families["reserved"].add_metric([*labels, "kv_tokens"], c.kv_tokens)
            obs = gw.core.observations.get(name)
            if obs is not None:
                for dim, value in zip(
                    ("tokens_per_s", "kv_tokens", "concurrency"), obs.usage.as_tuple(), strict=True
                ):
                    families["used"].add_metric([*labels, dim], value)
            families["debt"].add_metric(labels, scores.debt)
            families["burst"].add_metric(labels, scores.burst)
            families["priority"].add_metric(labels, view.priority)
        for name, pool_view in gw.core.pools.items():
            cap = pool_view.pool.capacity
            pc = gw.core.store.pool_counters(name, now)
            for dim, value in (
                ("tokens_per_s", cap.throughput),
                ("kv_tokens", cap.kv_tokens),
                ("concurrency", cap.concurrency),
            ):
                families["pool_capacity"].add_metric([name, dim], value)
            families["pool_reserved"].add_metric([name, "concurrency"], pc.concurrency)
            families["pool_reserved"].add_metric([name, "kv_tokens"], pc.kv_tokens)
            families["pool_reserved"].add_metric(
                [name, "bucket_tokens"], pc.bucket if math.isfinite(pc.bucket) else 0.0
            )
