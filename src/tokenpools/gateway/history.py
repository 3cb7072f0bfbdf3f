"""The short history the dashboard draws (`/admin/history`, `tokenpools top`): one sample per
update period of every pool and entitlement, in a ring buffer of `length` samples, and the last
refusals. Decisions are counted as they are made (a dict increment each); everything else is
read from a `Snapshot` when a sample is taken, off the admission path.

Memory: `length` = 120 samples (10 minutes at the default 5 s period) of one pool and 50
entitlements measured 4.2 MB with tracemalloc, and stayed there over 300 periods (~35 KB a
sample, growing with the entitlements); `refusals` keeps 50 entries.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.snapshot import Snapshot

LENGTH = 120
REFUSALS = 50
TTFTS = 512  # the most TTFTs kept per entitlement between two samples


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class _Counts:
    admitted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=TTFTS))


class History:
    def __init__(self, replica: str, length: int = LENGTH, refusals: int = REFUSALS) -> None:
        self.replica = replica
        self.samples: deque[dict[str, Any]] = deque(maxlen=length)
        self.refusals: deque[dict[str, Any]] = deque(maxlen=refusals)
        self._counts: dict[str, _Counts] = {}
        self._last: tuple[float, dict[str, tuple[int, Counter[str]]]] | None = None

    def _of(self, entitlement: str) -> _Counts:
        counts = self._counts.get(entitlement)
        if counts is None:
            counts = self._counts[entitlement] = _Counts()
        return counts

    def decided(self, entitlement: str, decision: Decision, now: float) -> None:
        counts = self._of(entitlement)
        if isinstance(decision, Admit):
            counts.admitted += 1
            return
        reason = decision.reason.value
        counts.refused[reason] += 1
        self.refusals.append(
            {
                "at": now,
                "entitlement": entitlement,
                "reason": reason,
                "retry_after_s": decision.retry_after_s,
                "message": decision.message,
            }
        )

    def first_token(self, entitlement: str, ttft_s: float) -> None:
        self._of(entitlement).ttfts.append(ttft_s)

    def sample(self, snap: Snapshot) -> None:
        """One sample: the snapshot's figures, with admissions and refusals per second since
        the last sample and the TTFTs seen since then."""
        previous_at, previous = self._last if self._last else (snap.at, {})
        seconds = snap.at - previous_at
        ents: dict[str, Any] = {}
        totals: dict[str, tuple[int, Counter[str]]] = {}
        for name, e in snap.entitlements.items():
            counts = self._of(name)
            before_admitted, before_refused = previous.get(name, (0, Counter()))
            totals[name] = (counts.admitted, counts.refused.copy())
            ttfts = list(counts.ttfts)
            counts.ttfts.clear()

            def per_s(n: int) -> float | None:
                return n / seconds if seconds > 0 else None

            ents[name] = {
                "pool": e.pool,
                "class": e.service_class,
                "state": e.state,
                "baseline_concurrency": e.baseline.concurrency,
                "in_flight": e.in_flight,
                "priority": e.priority,
                "debt": e.debt,
                "burst": e.burst,
                "admitted_per_s": per_s(counts.admitted - before_admitted),
                "refused_per_s": {
                    reason: per_s(n - before_refused.get(reason, 0))
                    for reason, n in counts.refused.items()
                },
                "admitted_total": counts.admitted,
                "refused_total": sum(counts.refused.values()),
                "ttft_p50_s": _quantile(ttfts, 0.5),
                "ttft_p99_s": _quantile(ttfts, 0.99),
            }
        used: dict[str, float] = {}  # tokens/s settled in the last update period, per pool
        for e in snap.entitlements.values():
            if e.used is not None:
                used[e.pool] = used.get(e.pool, 0.0) + e.used.throughput
        pools = {
            name: {
                "replicas": p.replicas,
                "desired_replicas": p.desired_replicas,
                "capacity": {
                    "concurrency": p.capacity.concurrency,
                    "kv_tokens": p.capacity.kv_tokens,
                    "tokens_per_s": p.capacity.throughput,
                },
                "in_flight": p.in_flight,
                "reserved": {"concurrency": p.reserved_concurrency, "kv_tokens": p.reserved_kv},
                "held_back": {"concurrency": p.holdback_concurrency, "kv_tokens": p.holdback_kv},
                "bucket_tokens": None if math.isinf(p.bucket_tokens) else p.bucket_tokens,
                "tokens_per_s_used": used.get(name),
                "utilization": (
                    p.reserved_concurrency / p.capacity.concurrency
                    if p.capacity.concurrency > 0
                    else None
                ),
            }
            for name, p in snap.pools.items()
        }
        self.samples.append({"at": snap.at, "pools": pools, "entitlements": ents})
        self._last = (snap.at, totals)
        for gone in self._counts.keys() - snap.entitlements.keys():  # removed by a reload
            del self._counts[gone]

    def as_json(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "samples": list(self.samples),
            "refusals": list(self.refusals),
        }
