"""The pieces of llm-d's flow control (llm-d/llm-d-router, pkg/epp/flowcontrol and
pkg/epp/framework/plugins/flowcontrol), restated with their defaults: the saturation detectors,
the usage-limit policies, program-aware fairness (least attained service), the sizing of
in-flight eviction and its confirmation grace. sim/llmd_flow.py puts them together as a
simulator policy.

Pure: no clock of their own (time is passed in, in seconds) and no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenpools.sim.policy import EndpointLoad

# Attained service, in weighted tokens: output costs twice an input token (strategy_las.go).
W_IN, W_OUT = 1, 2


# -- saturation detectors ---------------------------------------------------------------------


def utilization_saturation(
    endpoints: Sequence[EndpointLoad], queue_threshold: int = 5, kv_threshold: float = 0.8
) -> float:
    """The default detector (utilization/detector.go): per endpoint the roofline
    max(waiting / queueDepthThreshold, KV use / kvCacheUtilThreshold), averaged unweighted over
    endpoints; no endpoint reads as saturated (1.0)."""
    if not endpoints:
        return 1.0
    total = sum(max(e.waiting / queue_threshold, e.kv_usage / kv_threshold) for e in endpoints)
    return total / len(endpoints)


def concurrency_saturation(endpoints: Sequence[EndpointLoad], max_concurrency: int) -> float:
    """The concurrency detector in `requests` mode (concurrency/detector.go): requests in
    flight over the pool's aggregate capacity, endpoints × maxConcurrency."""
    if not endpoints:
        return 1.0
    inflight = sum(e.waiting + e.running for e in endpoints)
    return inflight / (max_concurrency * len(endpoints))


# -- the clock: dispatch cycles and scrapes -----------------------------------------------------

CYCLE_S = 0.001  # the processor's dispatch ticker (processor.go Run: time.Millisecond)
# The data layer refreshes each endpoint's metrics every 50 ms (--refresh-metrics-interval,
# server/options.go) and flow control caches the endpoint list as long (runner.go,
# NewCachedEndpointCandidates): one scrape per 50 ticks.
SCRAPE_TICKS = 50


def cycle(now: float) -> int:
    """The ticker's last tick at or before simulated time `now` (a hair of slack for float
    sums, so that k × CYCLE_S is tick k)."""
    return math.floor(now / CYCLE_S + 1e-6)


# -- usage-limit policies: one ceiling per band, highest band first ---------------------------


def static_ceilings(bands: int, threshold: float = 1.0) -> list[float]:
    """static-usage-limit-policy, llm-d's default (threshold 1.0: no gating)."""
    return [threshold] * bands


def holdback_ceilings(
    priorities: Sequence[int], min_ceiling: float, max_ceiling: float = 1.0, domain: str = "rank"
) -> list[float]:
    """priority-holdback-policy, shape linear: the highest band gets maxCeiling, the lowest
    minCeiling, evenly by rank or in proportion to the priority value; one band: maxCeiling."""
    n = len(priorities)
    if n <= 1:
        return [max_ceiling] * n
    spread = max_ceiling - min_ceiling
    if domain == "rank":
        return [max_ceiling - i * spread / (n - 1) for i in range(n)]
    top, bottom = priorities[0], priorities[-1]
    if top == bottom:
        return [max_ceiling] * n
    return [min_ceiling + (p - bottom) / (top - bottom) * spread for p in priorities]


class SoftReflectiveCeiling:
    """soft-reflective-ceiling-policy (usagelimits/softreflectiveceiling/policy.go): band i's
    reflective ceiling is 1 − i·s/(N − 1); a band at or past it is open on one call in
    round(s / (1 − s)), all such bands on the same calls (one shared tick); at s ≥ 1 they are
    closed. Band 0 is always 1.0.

    The tick advances on each call made while some band alternates (s in [0.5, 1)), and the
    processor calls once per dispatch cycle: it counts cycles, not time."""

    def __init__(self) -> None:
        self.tick = 0

    @staticmethod
    def _period(saturation: float) -> int | None:
        """Calls per open one while some band alternates; None when none does."""
        if not 1.0 - saturation <= saturation < 1.0:
            return None
        return max(1, round(saturation / (1.0 - saturation + 1e-9)))

    def ceilings(self, saturation: float, bands: int) -> list[float]:
        if bands <= 1:
            return [1.0] * bands
        period = self._period(saturation)
        open_now = False
        if period is not None:
            self.tick += 1
            open_now = self.tick % period == 0
        out = [1.0]
        for i in range(1, bands):
            reflective = 1.0 - i * saturation / (bands - 1)
            if saturation < reflective:
                out.append(1.0)
            elif saturation >= 1.0:
                out.append(0.0)
            else:
                out.append(1.0 if open_now else 0.0)
        return out

    def advance(self, saturation: float, bands: int, calls: int) -> None:
        """`calls` cycles ran at this saturation without needing their ceilings (each would
        have been blocked): the tick moves as if they had asked."""
        if bands > 1 and self._period(saturation) is not None:
            self.tick += calls

    def calls_to_open(self, saturation: float) -> int | None:
        """How many calls from now until the alternating bands are next open (1: the next
        call); None when no band alternates at this saturation."""
        period = self._period(saturation)
        return None if period is None else period - self.tick % period


# -- program-aware fairness: least attained service -------------------------------------------


@dataclass(slots=True)
class _Attained:
    service: float = 0.0
    anchor: float | None = None  # the instant up to which decay is folded in


class LeastAttainedService:
    """The `las` strategy of program-aware fairness (strategy_las.go): each program's attained
    service (input + 2 × output tokens of its completed requests) decays with a half-life, lazily
    on every read and write; among the flows with queued requests the pick maximises
    w_service·(1 − norm(service)) + w_wait·norm(head wait), each range-normalised over the
    candidates (0.5 when they are all equal). Go's map order breaks exact ties at random; here the
    first flow id in sorted order wins, so runs are reproducible."""

    def __init__(
        self, weight_service: float = 0.8, weight_head_wait: float = 0.2, half_life_s: float = 60
    ) -> None:
        self.weight_service, self.weight_head_wait = weight_service, weight_head_wait
        self.half_life_s = half_life_s
        self.programs: dict[str, _Attained] = {}

    def _decayed(self, program: str, now: float) -> _Attained:
        state = self.programs.setdefault(program, _Attained())
        if state.anchor is None:
            state.anchor = now
        elif now > state.anchor:
            if self.half_life_s > 0:
                state.service *= math.exp2(-(now - state.anchor) / self.half_life_s)
            state.anchor = now
        return state

    def service(self, program: str, now: float) -> float:
        return self._decayed(program, now).service

    def completed(self, program: str, prompt_tokens: int, output_tokens: int, now: float) -> None:
        self._decayed(program, now).service += W_IN * prompt_tokens + W_OUT * output_tokens

    def pick(self, head_enqueued: Mapping[str, float], now: float) -> str | None:
        """The flow to serve, from each non-empty flow's program and its head's enqueue time."""
        if not head_enqueued:
            return None
        ids = sorted(head_enqueued)
        service = {i: self.service(i, now) for i in ids}
        # llm-d reads the head's wait in whole milliseconds
        wait = {i: float(math.floor((now - head_enqueued[i]) * 1000)) for i in ids}
        lo_s, hi_s = min(service.values()), max(service.values())
        lo_w, hi_w = min(wait.values()), max(wait.values())
        best, best_score = None, -math.inf
        for i in ids:
            score = self.weight_service * (1 - _normalize(service[i], lo_s, hi_s))
            score += self.weight_head_wait * _normalize(wait[i], lo_w, hi_w)
            if score > best_score:
                best, best_score = i, score
        return best


def _normalize(value: float, low: float, high: float) -> float:
    return 0.5 if high == low else (value - low) / (high - low)


# -- in-flight eviction: how many to revoke ----------------------------------------------------


def revocations(
    saturation: float, ceiling: float, in_flight: int, evictable: int, max_per_decision: int = 2
) -> int:
    """The reclamation controller's sizing (reclamation.go): the deficit saturation − ceiling
    over the mean footprint of a request in flight (saturation / in_flight), at least one,
    at most maxRevocationsPerDecision and the evictable count."""
    if in_flight <= 0 or evictable <= 0 or saturation <= 0:
        return 0
    credit = saturation / in_flight
    target = saturation - ceiling
    if target < 0:
        return 0
    return min(max(1, math.ceil(target / credit)), max_per_decision, evictable)


# -- the confirmation grace between reclamation decisions ---------------------------------------

# The grace is derived from the detector, not configured (cmd/epp/runner/runner.go,
# deriveEvictionConfirmationGrace). The concurrency detector's counters drop when the evicted
# stream ends, so only dispatch-loop jitter separates confirmation from visibility; a scraped
# detector sees the room only once the engine has reclaimed it and a fresh scrape has landed.
LEADING_SENSOR_GRACE_S = 0.010  # evictionLeadingSensorGrace
REFRESH_METRICS_S = SCRAPE_TICKS * CYCLE_S  # --refresh-metrics-interval, 50 ms
METRICS_STALENESS_S = 2.0  # --metrics-staleness-threshold, server/options.go's default
ENGINE_RECLAIM_S = 0.250  # evictionEngineReclaimBudget: engine abort and KV garbage collection


def confirmation_grace(detector: str) -> float:
    """Seconds after a revocation is confirmed before the next reclamation decision."""
    if detector == "concurrency":
        return LEADING_SENSOR_GRACE_S
    return REFRESH_METRICS_S + METRICS_STALENESS_S + ENGINE_RECLAIM_S
