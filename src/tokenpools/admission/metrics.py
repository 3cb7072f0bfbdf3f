"""Prometheus metrics (labels pool, entitlement, class): counters bumped per decision and per
finished request, latency histograms named as the OpenTelemetry GenAI conventions name them
(gen_ai.server.time_to_first_token → gen_ai_server_time_to_first_token_seconds), and gauges
read from the core's snapshot when scraped (so the admission path pays for no gauge update).
Whichever host admits (the gateway, the ext_proc processor); a host registers collectors of
its own parts in `registry` (the gateway: its backends' health, its HTTP parser's refusals)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.store import StoreUnavailable

if TYPE_CHECKING:
    from tokenpools.admission.access_log import RequestRecord
    from tokenpools.admission.ledger import Ledger
    from tokenpools.admission.runtime import AdmissionRuntime
    from tokenpools.control.tenancy import Caller

LABELS = ["pool", "tenant", "entitlement", "class"]  # a tenant's are its entitlements
# OpenTelemetry's advice for gen_ai.server.* durations, in seconds
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1),
    *(0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 10 ms to 82 s
SUSPENDED_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


BUDGET = ["budget", "measure", "window"]


@dataclass(slots=True)
class _Bound:
    """One entitlement's children of the labelled metrics."""

    labels: tuple[str, str, str, str]
    admitted: Counter
    evicted: Counter
    duration: Histogram
    prompt_tokens: Counter
    completion_tokens: Counter
    cost: Counter
    ttft: Histogram
    tpot: Histogram
    suspended: Counter
    suspended_time: Histogram
    recomputed: Counter


class AdmissionMetrics:
    def __init__(self, admission: AdmissionRuntime, ledger: Ledger) -> None:
        self.registry = r = CollectorRegistry()
        self.admitted = Counter("tokenpools_admitted", "Requests admitted", LABELS, registry=r)
        self.rejected = Counter(
            "tokenpools_rejected", "Requests rejected", [*LABELS, "reason"], registry=r
        )
        self.evicted = Counter(
            "tokenpools_evicted", "In-flight requests evicted", LABELS, registry=r
        )
        self.unauthorized = Counter(
            "tokenpools_unauthorized",
            "Requests refused before admission: no, an unknown or an expired credential, a "
            "refused token, a tenant with nothing here",
            ["reason"],
            registry=r,
        )
        self.credentials = Counter(
            "tokenpools_credential_requests",
            "Requests by the credential that identified them (a key's label, jwt or header)",
            ["tenant", "credential"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenpools_prompt_tokens", "Prompt tokens of finished requests", LABELS, registry=r
        )
        self.completion_tokens = Counter(
            "tokenpools_completion_tokens", "Tokens generated for clients", LABELS, registry=r
        )
        self.cost = Counter(
            "tokenpools_cost_micros",
            "What finished requests cost at their pool's prices, in micro-units",
            LABELS,
            registry=r,
        )
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time to the first streamed token (streams only)",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first (streams only)",
            LABELS,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.suspended = Counter(
            "tokenpools_suspended",
            "Suspensions of lent requests (taken back, kept, resumed when room returns)",
            LABELS,
            registry=r,
        )
        self.suspended_time = Histogram(
            "tokenpools_suspended_seconds",
            "Time a suspended request waited for room, in all (one observation per request)",
            LABELS,
            buckets=SUSPENDED_BUCKETS,
            registry=r,
        )
        self.recomputed = Counter(
            "tokenpools_recomputed_prompt_tokens",
            "Prompt tokens resumed requests' engines prefilled again (not from their prefix "
            "cache): the engine work suspension cost",
            LABELS,
            registry=r,
        )
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Time from arrival to the last byte of admitted requests",
            LABELS,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        r.register(_StateCollector(admission, ledger))
        self._admission = admission
        self._series: dict[str, _Bound] = {}
        self._credentials: dict[tuple[str, str], Counter] = {}

    def _bound(self, entitlement: str) -> _Bound | None:
        """An entitlement's series, looked up once (prometheus_client's labels() costs a few
        microseconds a call) and again when a reload moves it to another pool or class."""
        view = self._admission.entitlements.get(entitlement)
        if view is None:  # removed by a reload while its request ran
            return None
        ent = view.ent
        labels = (ent.pool, ent.tenant_id, entitlement, ent.service_class.value)
        bound = self._series.get(entitlement)
        if bound is None or bound.labels != labels:
            bound = _Bound(
                labels,
                self.admitted.labels(*labels),
                self.evicted.labels(*labels),
                self.duration.labels(*labels),
                self.prompt_tokens.labels(*labels),
                self.completion_tokens.labels(*labels),
                self.cost.labels(*labels),
                self.ttft.labels(*labels),
                self.tpot.labels(*labels),
                self.suspended.labels(*labels),
                self.suspended_time.labels(*labels),
                self.recomputed.labels(*labels),
            )
            self._series[entitlement] = bound
        return bound

    def identified(self, caller: Caller) -> None:
        """A request's credential was accepted (its tenant is a known one: bounded labels)."""
        at = (caller.tenant, caller.credential)
        child = self._credentials.get(at)
        if child is None:
            child = self._credentials[at] = self.credentials.labels(*at)
        child.inc()

    def decided(self, entitlement: str, decision: Decision, now: float) -> None:
        """A decision listener of the admission runtime (`now` is the history's, not ours)."""
        del now
        bound = self._bound(entitlement)
        if bound is None:
            return
        if isinstance(decision, Admit):
            bound.admitted.inc()
            for victim in decision.evict:
                victim_series = self._bound(victim.entitlement)
                if victim_series is not None:
                    victim_series.evicted.inc()
        else:
            self.rejected.labels(*bound.labels, decision.reason.value).inc()

    def finished(self, record: RequestRecord) -> None:
        """An admitted request ended: its tokens and timings."""
        if record.decision != "admitted" or record.entitlement is None:
            return
        bound = self._bound(record.entitlement)
        if bound is None:
            return
        bound.duration.observe(record.duration_s)
        if record.prompt_tokens is not None:
            bound.prompt_tokens.inc(record.prompt_tokens)
        completion = record.completion_tokens or 0
        bound.completion_tokens.inc(completion)
        if record.cost_micros:
            bound.cost.inc(record.cost_micros)
        if record.suspensions:
            bound.suspended.inc(record.suspensions)
            bound.suspended_time.observe(record.suspended_s or 0.0)
            bound.recomputed.inc(record.recomputed_prompt_tokens or 0)
        if record.stream and record.ttft_s is not None:
            bound.ttft.observe(record.ttft_s)
            if completion > 1:
                per_token = (record.duration_s - record.ttft_s) / (completion - 1)
                bound.tpot.observe(max(0.0, per_token))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, admission: AdmissionRuntime, ledger: Ledger) -> None:
        self.admission, self.ledger = admission, ledger

    def collect(self) -> Iterator[Metric]:
        admission = self.admission
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
                ("replicas", "Replicas the pool's capacity counts", ["pool"]),
                ("desired_replicas", "Replicas the autoscaling rule asks for", ["pool"]),
                ("budget_used_ratio", "A budget's current window: used / limit", BUDGET),
                ("budget_used", "A budget's current window: charged", BUDGET),
                ("budget_held", "A budget's current window: held by requests in flight", BUDGET),
                ("budget_limit", "A budget's limit (tokens, or micro-units)", BUDGET),
            )
        }
        up = GaugeMetricFamily("tokenpools_store_up", "1 while the state store answers")
        fallback = GaugeMetricFamily(
            "tokenpools_fallback_in_flight",
            "Requests admitted on this replica's local budget while the store was unreachable",
        )
        fallback.add_metric([], admission.fallback_in_flight)
        estimated = CounterMetricFamily(
            "tokenpools_tokenizer_fallbacks",
            "Prompts estimated because the pool's tokenizer (tokenizer: backend) did not answer",
            labels=["pool"],
        )
        for name, counter in admission.counters.items():
            estimated.add_metric([name], counter.fallbacks)
        ledger = self.ledger.status()
        pending = GaugeMetricFamily(
            "tokenpools_usage_pending_rows",
            "Usage-ledger rows counted in the store and not yet committed to SQL",
        )
        pending.add_metric([], ledger.pending_rows)
        oldest = GaugeMetricFamily(
            "tokenpools_usage_oldest_pending_seconds",
            "How long the oldest pending usage-ledger row has waited for SQL (0: none)",
        )
        oldest.add_metric([], ledger.oldest_pending_s)
        failures = CounterMetricFamily(
            "tokenpools_usage_flush_failures", "Usage-ledger flushes that failed"
        )
        failures.add_metric([], ledger.flush_failures)
        written = CounterMetricFamily(
            "tokenpools_usage_rows_written", "Usage-ledger rows committed to SQL"
        )
        written.add_metric([], ledger.rows_written)
        try:
            self._collect_state(families)
            up.add_metric([], 1)
        except StoreUnavailable:
            up.add_metric([], 0)
        yield from families.values()
        yield from (up, fallback, estimated, pending, oldest, failures, written)

    def _collect_state(self, families: dict[str, GaugeMetricFamily]) -> None:
        now = self.admission.clock()
        snap = self.admission.snapshot(now)
        for name, e in snap.entitlements.items():
            labels = [e.pool, e.tenant, name, e.service_class]
            families["in_flight"].add_metric(labels, e.in_flight)
            families["reserved"].add_metric([*labels, "concurrency"], e.reserved_concurrency)
            families["reserved"].add_metric([*labels, "kv_tokens"], e.reserved_kv)
            if e.used is not None:
                for dim, value in e.used.as_dict().items():
                    families["used"].add_metric([*labels, dim], value)
            families["debt"].add_metric(labels, e.debt)
            families["burst"].add_metric(labels, e.burst)
            families["priority"].add_metric(labels, e.priority)
        for b in self.admission.budget_status(now):
            labels = [b["name"], b["measure"], b["window"]]
            families["budget_used_ratio"].add_metric(labels, b["used_ratio"])
            families["budget_used"].add_metric(labels, b["used"])
            families["budget_held"].add_metric(labels, b["held"])
            families["budget_limit"].add_metric(labels, b["limit"])
        for name, p in snap.pools.items():
            for dim, value in p.capacity.as_dict().items():
                families["pool_capacity"].add_metric([name, dim], value)
            families["pool_reserved"].add_metric([name, "concurrency"], p.reserved_concurrency)
            families["pool_reserved"].add_metric([name, "kv_tokens"], p.reserved_kv)
            families["pool_reserved"].add_metric(
                [name, "bucket_tokens"], p.bucket_tokens if math.isfinite(p.bucket_tokens) else 0.0
            )
            families["replicas"].add_metric([name], p.replicas)
            families["desired_replicas"].add_metric([name], p.desired_replicas)
