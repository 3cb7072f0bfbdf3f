"""Sampling arrivals and token lengths from a seeded random source."""

from __future__ import annotations

import math
import random

from tokenpools.sim.scenario import Lengths, Tenant, Workload


def sample_length(spec: Lengths, rng: random.Random) -> int:
    if spec.kind == "fixed":
        assert spec.value is not None
        return spec.value
    if spec.kind == "uniform":
        assert spec.low is not None and spec.high is not None
        return rng.randint(spec.low, spec.high)
    if spec.kind == "list":
        assert spec.values is not None
        return rng.choice(spec.values)
    assert spec.mean is not None and spec.sigma is not None
    # Parameterised by the distribution's own mean: μ = ln(mean) − σ²/2.
    mu = math.log(spec.mean) - spec.sigma**2 / 2
    value = max(1, round(rng.lognormvariate(mu, spec.sigma)))
    return min(value, spec.max) if spec.max is not None else value


def next_gap(kind: str, rate: float, cv: float, rng: random.Random) -> float:
    """Time to the next open-loop arrival at `rate` per second."""
    if kind == "poisson" or cv == 1.0:
        return rng.expovariate(rate)
    shape = 1.0 / (cv * cv)  # gamma gaps with mean 1/rate and the given coefficient of variation
    return rng.gammavariate(shape, 1.0 / (rate * shape))


def backoff_s(
    attempt: int, retry_after_s: float | None, jitter: float, rng: random.Random
) -> float:
    """Wait before attempt `attempt + 1`: Retry-After ± jitter when given, else the openai
    client's exponential backoff (0.5 s doubling, capped at 8 s) with the same jitter."""
    base = retry_after_s if retry_after_s is not None else min(8.0, 0.5 * 2 ** (attempt - 1))
    return base * (1.0 + jitter * (2.0 * rng.random() - 1.0))


def workload_at(tenant: Tenant, t: float) -> tuple[Workload, float]:
    """The tenant's workload with every change up to time t applied, and its rate factor."""
    w, factor = tenant.workload, 1.0
    for change in tenant.changes:
        if change.at_s <= t:
            factor *= change.rate_factor or 1.0
            updates = {
                k: v
                for k, v in (
                    ("output", change.output),
                    ("prompt", change.prompt),
                    ("max_tokens", change.max_tokens),
                )
                if v is not None
            }
            w = w.model_copy(update=updates)
    return w, factor
