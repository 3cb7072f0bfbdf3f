"""Observed usage and the two EWMAs fed by it: debt (Eq. 2) and burst (Eq. 3)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenpools.control.store import Window
from tokenpools.model.resources import Resources


@dataclass(frozen=True, slots=True)
class Observation:
    """One update period's usage as rates: λ̂ (settled tokens/s), χ̂ (KV tokens), r̂
    (sequences); the demand (tokens/s requested, admitted or not) and the admitted tokens/s."""

    usage: Resources
    demand_tokens_per_s: float
    admitted_tokens_per_s: float = 0.0

    # written out for mypyc (control/store_terms.py says why, above Lease)
    def __init__(
        self, usage: Resources, demand_tokens_per_s: float, admitted_tokens_per_s: float = 0.0
    ) -> None:
        object.__setattr__(self, "usage", usage)
        object.__setattr__(self, "demand_tokens_per_s", demand_tokens_per_s)
        object.__setattr__(self, "admitted_tokens_per_s", admitted_tokens_per_s)


def observe(window: Window) -> Observation:
    if window.seconds <= 0:
        return Observation(Resources(), 0.0)
    s = window.seconds
    return Observation(
        Resources(window.settled_tokens / s, window.kv_seconds / s, window.concurrency_seconds / s),
        window.demand_tokens / s,
        window.admitted_tokens / s,
    )


def service_gap(baseline_tokens_per_s: float, obs: Observation) -> float:
    """g_e = (min(λ_e, demand) − λ̂_e) / λ_e, clamped to [−1, 1].

    Demand-aware: a tenant that asked for less than its baseline is owed only what it asked
    for, so idleness never turns into debt. λ̂ here is what admission granted in the period,
    counted at the same instant as the demand: settled tokens arrive a service time later,
    and with a few completions per period that lag alone swings the gap by tens of percent.
    Clamping bounds what one period can move.
    """
    if baseline_tokens_per_s <= 0:
        return 0.0
    owed = min(baseline_tokens_per_s, obs.demand_tokens_per_s)
    gap = (owed - obs.admitted_tokens_per_s) / baseline_tokens_per_s
    return max(-1.0, min(1.0, gap))


def burst_excess(baseline: Resources, obs: Observation) -> float:
    """δ_e = Σ over dimensions of max(0, observed/entitled − 1); unentitled dimensions skipped."""
    total = 0.0
    for used, entitled in zip(obs.usage.as_tuple(), baseline.as_tuple(), strict=True):
        if entitled > 0:
            total += max(0.0, used / entitled - 1.0)
    return total


def ewma(previous: float, sample: float, gamma: float) -> float:
    """x(k) = γ·x(k−1) + (1−γ)·sample (the decay is the anti-windup of the debt integral)."""
    return gamma * previous + (1.0 - gamma) * sample
