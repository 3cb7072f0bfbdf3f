"""Binding: whether an entitlement's baseline fits its pool, as kube-scheduler would decide
for a lease pod on the pool's virtual node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenpools.model.entitlement import BindingState, Entitlement
from tokenpools.model.policy import Policy
from tokenpools.model.pool import Pool
from tokenpools.model.resources import Resources
from tokenpools.model.service_class import CLASS_SEMANTICS, ServiceClass


def bind(
    pool: Pool,
    entitlements: Sequence[Entitlement],
    previous: Mapping[str, BindingState],
    policy: Policy,
    now: float,
) -> dict[str, BindingState]:
    """Bind one pool's entitlements; the result has a state for every entitlement given.

    Reserved baselines (dedicated, then guaranteed) must fit the capacity in all three
    dimensions; elastic baselines, time-averaged, bind while Σ baselines ≤ capacity ×
    oversubscription; spot and preemptible hold no baseline and always bind. Within a class,
    entitlements already Bound keep their place ahead of newcomers (a scheduler does not evict
    a running lease pod for a pending one); otherwise the config order decides.
    """
    capacity = pool.capacity
    elastic_capacity = capacity.scale(policy.elastic_oversubscription)
    states: dict[str, BindingState] = {}
    live = []
    for ent in entitlements:
        if ent.expires_at is not None and now >= ent.expires_at:
            states[ent.name] = BindingState.EXPIRED
        else:
            live.append(ent)

    def order(indexed: tuple[int, Entitlement]) -> tuple[int, int, int]:
        i, ent = indexed
        was_bound = previous.get(ent.name) == BindingState.BOUND
        return (CLASS_SEMANTICS[ent.service_class].bind_rank, 0 if was_bound else 1, i)

    placed = Resources()
    for _, ent in sorted(enumerate(live), key=order):
        cls = ent.service_class
        if cls in (ServiceClass.SPOT, ServiceClass.PREEMPTIBLE):
            states[ent.name] = BindingState.BOUND
            continue
        limit = capacity if CLASS_SEMANTICS[cls].reserved else elastic_capacity
        if (placed + ent.baseline).fits_within(limit):
            placed = placed + ent.baseline
            states[ent.name] = BindingState.BOUND
        elif previous.get(ent.name) in (BindingState.BOUND, BindingState.DEGRADED):
            states[ent.name] = BindingState.DEGRADED
        else:
            states[ent.name] = BindingState.PENDING
    return states
