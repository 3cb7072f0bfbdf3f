"""Desired replicas from the same capacity model that admission uses."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tokenpools.control.ledger import Observation
from tokenpools.model.entitlement import Entitlement
from tokenpools.model.pool import Pool
from tokenpools.model.resources import Resources
from tokenpools.model.service_class import ServiceClass


def capacity_need(
    entitlements: Sequence[Entitlement], observations: Mapping[str, Observation]
) -> Resources:
    """Reserved baselines (wanted whether bound or not) plus the part of each elastic baseline
    that its tenant currently demands. Spot and preemptible ride on surplus and never scale
    the pool; bursts are served from unused entitlements first."""
    need = Resources()
    for ent in entitlements:
        if ent.protected:
            need = need + ent.baseline
        elif ent.service_class == ServiceClass.ELASTIC and ent.baseline.throughput > 0:
            obs = observations.get(ent.name)
            demanded = 0.0 if obs is None else obs.demand_tokens_per_s
            need = need + ent.baseline.scale(min(1.0, demanded / ent.baseline.throughput))
    return need


def desired_replicas(pool: Pool, need: Resources) -> int:
    """clamp(⌈max over dimensions of need / per-replica capacity⌉, min, max)."""
    replicas = math.ceil(need.max_ratio(pool.per_replica) - 1e-9)
    return max(pool.min_replicas, min(pool.max_replicas, replicas))


def baseline_need(entitlements: Sequence[Entitlement]) -> Resources:
    """The need when demand is not observed (the operator): every reserved and elastic
    baseline in full — what the lease pods ask the virtual node for."""
    need = Resources()
    for ent in entitlements:
        if ent.protected or ent.service_class == ServiceClass.ELASTIC:
            need = need + ent.baseline
    return need
