"""Who may evict preemptible work, and which leases make room: the rule every store runs
inside its atomic admission (state/redis/lua/reserve.lua is its port) and the core runs when
capacity shrinks."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence

from tokenpools.control.store import Lease, PoolCounters, ReservePlan
from tokenpools.model.policy import Policy
from tokenpools.model.resources import Resources
from tokenpools.model.service_class import PROTECTED, ServiceClass

# An elastic entitlement under-served by more than this (debt, a fraction of its baseline) is
# owed capacity. Not 0: debt decays geometrically, so any past shortfall stays above 0.
OWED_DEBT = 0.01


def is_lent(service_class: ServiceClass, policy: Policy) -> bool:
    """Whether a class's requests run on lent capacity: they may fill what the pool owes
    others (unused protected baselines included), and are taken back when an owner needs it.
    Preemptible work always is (taking it back ends it); spot work too where taking back
    suspends instead (docs/decisions.md, "Lending, and taking back"): a suspended request loses
    nothing but time, so there is no reason to keep it off idle capacity. (A spot request the
    host cannot resume is not lent: `RequestCost.resumable`.) Elastic work is not lent: its
    baseline is its own, and the debt mechanism, not suspension, gives it back its share."""
    if service_class == ServiceClass.PREEMPTIBLE:
        return True
    return policy.suspend and service_class == ServiceClass.SPOT


def may_evict(service_class: ServiceClass, debt: float) -> bool:
    """Eviction takes back capacity the pool owes: to dedicated and guaranteed requests, and
    to elastic ones while their debt says they are under-served. Spot, preemptible and elastic
    work that is served take only free capacity, and wait (429, Retry-After) like everyone
    else competing for it: a request already running is not ended for work nobody promised."""
    if service_class in PROTECTED:
        return True
    return service_class == ServiceClass.ELASTIC and debt > OWED_DEBT


def turn(period: int, name: str) -> int:
    """Among lent entitlements of equal priority, who is taken back first in update period
    `period`: a different one each period, the same on every replica. A fixed order (by
    name) took back the same tenant again and again: in the scale scenario the first of eight
    equal batch tenants completed 30 % less than the others."""
    return zlib.crc32(f"{period}:{name}".encode())


def eviction_order(
    groups: Mapping[str, Mapping[str, Lease]], order: Sequence[str]
) -> Iterator[Lease]:
    """The leases of the entitlements in `order`, entitlement by entitlement; within one the
    newest first (it has lost the least work). `groups` holds each entitlement's leases
    oldest first."""
    for name in order:
        group = groups.get(name)
        if group:
            yield from reversed(list(group.values()))


def refund_when_taken(lease: Lease) -> float:
    """The tokens a lease taken back gives back to the pool's token bucket: its whole
    reservation where its host suspends it (the continuation reserves again what is left to
    do, the prompt to prefill again included, so the request is charged once), none where
    taking it back ends it (that work was done, and is lost)."""
    return lease.tokens if lease.resumable else 0.0


def choose_victims(
    counters: PoolCounters,
    plan: ReservePlan,
    kv: float,
    tokens: float,
    groups: Mapping[str, Mapping[str, Lease]],
    order: Sequence[str],
) -> list[Lease]:
    """Leases, in eviction order, until a request of `kv` KV tokens reserving `tokens` fits
    the pool's shared capacity and token bucket; none if it never would."""
    need_c = counters.concurrency + 1 - plan.shared_concurrency
    need_k = counters.kv_tokens + kv - plan.shared_kv
    if need_c > counters.preemptible_concurrency or need_k > counters.preemptible_kv:
        return []
    need_t = tokens - counters.bucket + plan.shared_bucket_floor
    if need_t > counters.reclaimable_tokens + 1e-6:  # all the lent work gives back too little
        return []
    victims, enough = until_fits((need_c, need_k), groups, order, need_tokens=need_t)
    return victims if enough else []


def until_fits(
    need: tuple[float, float],
    groups: Mapping[str, Mapping[str, Lease]],
    order: Sequence[str],
    need_tokens: float = 0.0,
) -> tuple[list[Lease], bool]:
    """Leases in eviction order until they free `need` (sequences, KV tokens) and give back
    `need_tokens` to the pool's bucket (`refund_when_taken`), and whether they do. Once only
    tokens are needed, a lease that gives none back is passed over: taking it would end work
    for nothing."""
    need_c, need_k = need
    taken: list[Lease] = []
    for lease in eviction_order(groups, order):
        if need_c <= 0 and need_k <= 0:
            if need_tokens <= 0:
                break
            if refund_when_taken(lease) <= 0:
                continue
        taken.append(lease)
        need_c -= 1
        need_k -= lease.kv_tokens
        need_tokens -= refund_when_taken(lease)
    return taken, need_c <= 0 and need_k <= 0 and need_tokens <= 0


def overdrawn(
    counters: PoolCounters, capacity: Resources, held: tuple[float, float]
) -> tuple[float, float]:
    """How far the work that is not lent, with the unused part `held` of the protected owners'
    baselines, exceeds the pool's capacity, in sequences and KV tokens: how much must go for
    the owners' whole baselines to fit beside the rest. Admission keeps it at or below 0 for
    every bound owner (the reserved limits); only a capacity loss under work already running
    takes it above."""
    return (
        counters.concurrency - counters.preemptible_concurrency + held[0] - capacity.concurrency,
        counters.kv_tokens - counters.preemptible_kv + held[1] - capacity.kv_tokens,
    )


def elastic_to_take_back(
    over: tuple[float, float],
    groups: Mapping[str, Mapping[str, Lease]],
    order: Sequence[str],
) -> list[Lease]:
    """Elastic work to take back after a capacity loss, where its host suspends it: the
    resumable leases of the entitlements in `order` (lowest priority first), each one's
    newest first, until what is `over` fits again (fewer if they run out). Elastic baselines
    are time-averaged and oversubscribed; the reserved ones are a promise, so work that sits
    on them when capacity shrinks waits, suspended, instead of the owner (docs/decisions.md,
    "Lending, and taking back")."""
    return until_fits(over, groups, order)[0]
