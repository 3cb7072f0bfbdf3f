"""`make demo`'s account of taking back, read from the gateway's metrics: counts summed over
entitlements, and the suspended time's quantiles interpolated within the histogram's buckets
(as Prometheus' histogram_quantile does), checked against observations placed in known
buckets."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tokenpools.admission.metrics import SUSPENDED_BUCKETS
from tokenpools.demo import TakenBack


def metrics_text(waits: list[float], evicted: int, suspended: int, recomputed: int) -> str:
    r = CollectorRegistry()
    labels = ["entitlement"]
    hist = Histogram(
        "tokenpools_suspended_seconds", "", labels, buckets=SUSPENDED_BUCKETS, registry=r
    )
    for i, wait in enumerate(waits):
        hist.labels(f"e{i % 2}").observe(wait)  # two entitlements: summed by bucket
    for name, value in (("evicted", evicted), ("suspended", suspended),
                        ("recomputed_prompt_tokens", recomputed)):  # fmt: skip
        Counter(f"tokenpools_{name}", "", labels, registry=r).labels("e0").inc(value)
    return generate_latest(r).decode()


def test_counts_and_quantiles_of_the_suspended_time() -> None:
    # 100 requests: 60 waited 0.1–0.25 s, 39 waited 1–2.5 s, one 50 s
    waits = [0.2] * 60 + [2.0] * 39 + [50.0]
    back = TakenBack.from_metrics(metrics_text(waits, 120, 101, 900))
    assert (back.taken_back, back.suspensions, back.recomputed_prompt_tokens) == (120, 101, 900)
    # the 50th of 100 lies in (0.1, 0.25], holding the 1st to the 60th: 0.1 + 0.15 × 50/60
    assert back.suspended_p50_s == pytest.approx(0.225)
    # the 99th in (1, 2.5], holding the 61st to the 99th: its upper bound
    assert back.suspended_p99_s == pytest.approx(2.5)


def test_nothing_suspended_has_no_quantiles() -> None:
    back = TakenBack.from_metrics(metrics_text([], 3, 0, 0))
    assert back == TakenBack(3, 0, 0, None, None)
