"""Placement: the integer resource vectors that both the core's binding and kube-scheduler fit.

This module is the one declaration of how a pool and an entitlement look to a scheduler. The
core's `bind()` fits these vectors; the operator writes the same vectors into the virtual
Node's allocatable and the lease pods' requests, so Kubernetes and the file mode agree.

Two families of extended resources, because binding has two limits:
- `tokenpools.io/{tokens-per-second,kv-tokens,concurrency}`: the pool's capacity C. Only
  reserved baselines (dedicated, guaranteed) request it, so they must fit C.
- `tokenpools.io/shared-*`: the time-averaged room, C × elasticOversubscription. Reserved and
  elastic baselines request it, so Σ reserved + Σ elastic ≤ C × oversubscription.
Spot and preemptible request neither: they hold no baseline and always bind.

Extended resources are integers and cannot be overcommitted: the node rounds down and a pod
rounds up, so rounding never grants more than the pool has (at most one token/s, one KV token
or one sequence per pod is lost to it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tokenpools.model.entitlement import Entitlement
from tokenpools.model.pool import Pool
from tokenpools.model.service_class import CLASS_SEMANTICS, ServiceClass

DOMAIN = "tokenpools.io"
DIMENSIONS = ("tokens-per-second", "kv-tokens", "concurrency")
RESOURCE_PREFIX = f"{DOMAIN}/"  # every extended resource tokenpools declares starts so
CAPACITY_RESOURCES = tuple(f"{DOMAIN}/{d}" for d in DIMENSIONS)
SHARED_RESOURCES = tuple(f"{DOMAIN}/shared-{d}" for d in DIMENSIONS)

# Small integer quantities; beyond this a value is clamped (2^53: exact in a float and in JSON).
_MAX = 2**53


@dataclass(frozen=True, slots=True)
class PriorityClassSpec:
    name: str
    value: int
    preempts: bool  # False → preemptionPolicy: Never (waits, never evicts others)
    description: str


# Higher binds first and is reclaimed last, as CLASS_SEMANTICS' bind_rank says. Equal values
# never preempt each other, which is the core's "a Bound entitlement keeps its place": so
# dedicated and guaranteed share one value, and a new dedicated lease pod waits (FIFO within
# the priority) rather than preempt a bound guaranteed one.
PRIORITY_CLASSES: dict[ServiceClass, PriorityClassSpec] = {
    ServiceClass.DEDICATED: PriorityClassSpec(
        "tokenpools-dedicated", 900_000, True, "tokenpools lease pods: dedicated baselines"
    ),
    ServiceClass.GUARANTEED: PriorityClassSpec(
        "tokenpools-guaranteed", 900_000, True, "tokenpools lease pods: guaranteed baselines"
    ),
    ServiceClass.ELASTIC: PriorityClassSpec(
        "tokenpools-elastic", 100_000, True, "tokenpools lease pods: elastic baselines"
    ),
    ServiceClass.SPOT: PriorityClassSpec(
        "tokenpools-spot", 1_000, False, "tokenpools lease pods: spot (no baseline)"
    ),
    ServiceClass.PREEMPTIBLE: PriorityClassSpec(
        "tokenpools-preemptible", 100, False, "tokenpools lease pods: preemptible (no baseline)"
    ),
}


def _floor(x: float) -> int:
    return min(_MAX, math.floor(x + 1e-9))  # 1e-9: 0.1 × 3 must not lose a whole unit


def _ceil(x: float) -> int:
    return min(_MAX, math.ceil(x - 1e-9))


def pool_allocatable(pool: Pool, oversubscription: float) -> dict[str, int]:
    """What the pool's virtual node advertises for its capacity (replicas × per replica)."""
    capacity = pool.capacity
    shared = capacity.scale(oversubscription)
    return {
        **dict(zip(CAPACITY_RESOURCES, map(_floor, capacity.as_tuple()), strict=True)),
        **dict(zip(SHARED_RESOURCES, map(_floor, shared.as_tuple()), strict=True)),
    }


def lease_requests(ent: Entitlement) -> dict[str, int]:
    """What the entitlement's lease pod requests (and limits: the two must be equal)."""
    sem = CLASS_SEMANTICS[ent.service_class]
    if ent.service_class in (ServiceClass.SPOT, ServiceClass.PREEMPTIBLE):
        return {}
    need = list(map(_ceil, ent.baseline.as_tuple()))
    out = dict(zip(SHARED_RESOURCES, need, strict=True))
    if sem.reserved:
        out |= dict(zip(CAPACITY_RESOURCES, need, strict=True))
    return {k: v for k, v in out.items() if v > 0}


def fits(requests: Mapping[str, int], used: Mapping[str, int], alloc: Mapping[str, int]) -> bool:
    """NodeResourcesFit for extended resources: used + request ≤ allocatable, each name."""
    return all(used.get(k, 0) + v <= alloc.get(k, 0) for k, v in requests.items() if v > 0)


def add(used: Mapping[str, int], requests: Mapping[str, int]) -> dict[str, int]:
    out = dict(used)
    for k, v in requests.items():
        out[k] = out.get(k, 0) + v
    return out


def first_fit(
    ordered: Iterable[tuple[str, Mapping[str, int]]], alloc: Mapping[str, int]
) -> set[str]:
    """The names kept when each request, in the order given, takes room if it still fits."""
    used: dict[str, int] = {}
    kept = set()
    for name, requests in ordered:
        if fits(requests, used, alloc):
            used = add(used, requests)
            kept.add(name)
    return kept


@dataclass(frozen=True, slots=True)
class Placed:
    """A lease pod bound to a virtual node, as the node's kubelet sees it."""

    name: str
    priority: int
    requests: Mapping[str, int]
    started: int  # start order: older pods are kept first


def survivors(placed: list[Placed], alloc: Mapping[str, int]) -> set[str]:
    """The pods a shrunk node keeps: first-fit in the scheduler's order of importance (higher
    priority, then older), the same rule as the core's binding; the rest are evicted."""
    ordered = sorted(placed, key=lambda p: (-p.priority, p.started, p.name))
    return first_fit(((p.name, p.requests) for p in ordered), alloc)
