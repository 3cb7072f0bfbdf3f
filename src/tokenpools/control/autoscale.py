"""Desired replicas from the same capacity model that admission uses."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenpools.control.observation import Observation
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


@dataclass(slots=True)
class Hysteresis:
    """When to act on desired replicas, so one noisy update period does not buy a GPU: ask
    for more once the need has stayed above what is provisioned for `up_after_s`; drain one
    once it has stayed below what serves for `down_after_s` (and nothing is starting)."""

    up_after_s: float
    down_after_s: float
    _above_since: float | None = None
    _below_since: float | None = None

    def step(self, provisioned: int, serving: int, desired: int, now: float) -> int:
        """Replicas to ask for (> 0), one to drain (-1), or 0 to wait."""
        if desired > provisioned:
            self._below_since = None
            if self._above_since is None:
                self._above_since = now
            if now - self._above_since >= self.up_after_s:
                self._above_since = None
                return desired - provisioned
            return 0
        self._above_since = None
        if desired < serving and provisioned == serving:
            if self._below_since is None:
                self._below_since = now
            if now - self._below_since >= self.down_after_s:
                self._below_since = now  # the next one waits a full delay again
                return -1
            return 0
        self._below_since = None
        return 0
