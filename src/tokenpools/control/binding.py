"""Binding: whether an entitlement's baseline fits its pool, exactly as kube-scheduler decides
for its lease pod on the pool's virtual node (control/placement.py declares the vectors)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenpools.control.placement import first_fit, lease_requests, pool_allocatable
from tokenpools.model.entitlement import BindingState, Entitlement
from tokenpools.model.policy import Policy
from tokenpools.model.pool import Pool
from tokenpools.model.service_class import CLASS_SEMANTICS

_NEW = 2**62  # an entitlement the core has not placed yet queues behind every other


def bind(
    pool: Pool,
    entitlements: Sequence[Entitlement],
    previous: Mapping[str, BindingState],
    policy: Policy,
    now: float,
    since: Mapping[str, int] | None = None,
) -> dict[str, BindingState]:
    """Bind one pool's entitlements; the result has a state for every entitlement given.

    Reserved baselines (dedicated, then guaranteed) must fit the capacity in all three
    dimensions; reserved and elastic baselines together must fit capacity × oversubscription;
    spot and preemptible hold no baseline and always bind. This is first-fit in the order a
    scheduler with priority preemption reaches: higher classes first (they preempt lower ones);
    within a class, Bound entitlements before waiting ones (equal priorities never preempt),
    each group in `since` order — when it bound (older is kept, as the scheduler's victim
    choice keeps older pods) or when it started waiting (the scheduling queue is FIFO within a
    priority). Without `since`, the order given.
    """
    position = since or {}

    def order(indexed: tuple[int, Entitlement]) -> tuple[int, int, int, int]:
        i, ent = indexed
        was_bound = previous.get(ent.name) == BindingState.BOUND
        rank = CLASS_SEMANTICS[ent.service_class].bind_rank
        return (rank, 0 if was_bound else 1, position.get(ent.name, _NEW), i)

    live = sorted(((i, e) for i, e in enumerate(entitlements) if not _expired(e, now)), key=order)
    alloc = pool_allocatable(pool, policy.elastic_oversubscription)
    bound = first_fit(((e.name, lease_requests(e)) for _, e in live), alloc)
    # in binding order, which the core's `since` bookkeeping follows
    states = {e.name: BindingState.EXPIRED for e in entitlements if _expired(e, now)}
    for _, ent in live:
        if ent.name in bound:
            states[ent.name] = BindingState.BOUND
        elif previous.get(ent.name) in (BindingState.BOUND, BindingState.DEGRADED):
            states[ent.name] = BindingState.DEGRADED
        else:
            states[ent.name] = BindingState.PENDING
    return states


def external_states(
    entitlements: Sequence[Entitlement], given: Mapping[str, BindingState], now: float
) -> dict[str, BindingState]:
    """States decided elsewhere (kube-scheduler, through the operator's status): an
    entitlement the outside has not decided on yet is Pending; expiry still applies."""
    return {
        e.name: BindingState.EXPIRED
        if _expired(e, now)
        else given.get(e.name, BindingState.PENDING)
        for e in entitlements
    }


def _expired(ent: Entitlement, now: float) -> bool:
    return ent.expires_at is not None and now >= ent.expires_at
