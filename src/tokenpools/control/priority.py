"""Eq. 1: one scalar priority per entitlement drives every ordering decision."""

from __future__ import annotations

from collections.abc import Iterable

from tokenpools.model.policy import Policy
from tokenpools.model.service_class import ServiceClass


def priority(
    service_class: ServiceClass,
    slo_target_ms: float | None,
    slo_reference_ms: float,
    burst: float,
    debt: float,
    policy: Policy,
) -> float:
    """w_e = w_κ · (1 + α_slo·ℓ*_e/ℓ̄*)^-1 · (1 + α_burst·b_e)^-1 · (1 + α_debt·d_e).

    An entitlement without an SLO target is treated as if its target were the pool's mean.
    Negative debt (credit from over-service) divides instead of multiplying by a negative
    number: (1 + α_debt·|d|)^-1, so priority stays positive and falls smoothly through d = 0.
    """
    slo_ratio = 1.0 if slo_target_ms is None else slo_target_ms / slo_reference_ms
    slo_factor = 1.0 / (1.0 + policy.alpha_slo * slo_ratio)
    burst_factor = 1.0 / (1.0 + policy.alpha_burst * max(0.0, burst))
    debt_factor = (
        1.0 + policy.alpha_debt * debt if debt >= 0 else 1.0 / (1.0 - policy.alpha_debt * debt)
    )
    return policy.class_weights[service_class] * slo_factor * burst_factor * debt_factor


def slo_reference(pinned_ms: float | None, bound_slo_targets_ms: Iterable[float | None]) -> float:
    """ℓ̄*: pinned by the pool, else the mean SLO target of its Bound entitlements that set one."""
    if pinned_ms is not None:
        return pinned_ms
    targets = [t for t in bound_slo_targets_ms if t is not None]
    return sum(targets) / len(targets) if targets else 1000.0
