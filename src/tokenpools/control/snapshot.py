"""The state of every pool and entitlement at one instant, as hosts show it (admin API,
metrics, dashboards): one read of the store per pool and per entitlement, nothing else."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenpools.model.resources import Resources

if TYPE_CHECKING:
    from tokenpools.control.core import DecisionCore


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    name: str
    replicas: int
    desired_replicas: int
    capacity: Resources
    in_flight: int
    reserved_concurrency: float
    reserved_kv: float
    holdback_concurrency: float
    holdback_kv: float
    claimed_concurrency: float  # what surplus work leaves free for the others (backfill.py)
    claimed_kv: float
    bucket_tokens: float  # the pool's token bucket now; inf: no bucket
    slo_reference_ms: float


@dataclass(frozen=True, slots=True)
class EntitlementSnapshot:
    name: str
    tenant: str
    pool: str
    service_class: str
    state: str
    baseline: Resources
    in_flight: int
    reserved_concurrency: float
    reserved_kv: float
    used: Resources | None  # over the last update period; None before the first one
    bucket_tokens: float | None  # None: no bucket of its own
    debt: float
    burst: float
    priority: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float
    pools: dict[str, PoolSnapshot]
    entitlements: dict[str, EntitlementSnapshot]


def snapshot(core: DecisionCore, now: float) -> Snapshot:
    """Reads the store (StoreUnavailable when it is away)."""
    pools = {}
    for name, view in core.pools.items():
        c = core.store.pool_counters(name, now)
        pools[name] = PoolSnapshot(
            name,
            view.pool.replicas,
            core.desired_replicas(name),
            view.pool.capacity,
            c.leases,
            c.concurrency,
            c.kv_tokens,
            c.holdback_concurrency,
            c.holdback_kv,
            c.claimed_concurrency,
            c.claimed_kv,
            c.bucket,
            view.slo_reference_ms,
        )
    ents = {}
    for name, ev in core.entitlements.items():
        ec = core.store.entitlement_counters(name, now)
        scores = core.store.scores(name, now)
        obs = core.observations.get(name)
        ents[name] = EntitlementSnapshot(
            name,
            ev.ent.tenant_id,
            ev.ent.pool,
            ev.ent.service_class.value,
            ev.state.value,
            ev.ent.baseline,
            ec.leases,
            ec.concurrency,
            ec.kv_tokens,
            None if obs is None else obs.usage,
            None if math.isinf(ec.bucket) else ec.bucket,
            scores.debt,
            scores.burst,
            ev.priority,
        )
    return Snapshot(now, pools, ents)
