"""Which preemptible leases make room: the rule every store runs inside its atomic admission
(state/lua/reserve.lua is its port) and the core runs when capacity shrinks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from tokenpools.control.store import Lease, PoolCounters, ReservePlan


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


def choose_victims(
    counters: PoolCounters,
    plan: ReservePlan,
    kv: float,
    groups: Mapping[str, Mapping[str, Lease]],
    order: Sequence[str],
) -> list[Lease]:
    """Leases, in eviction order, until a request of `kv` tokens fits the pool's shared
    capacity; none if it never would."""
    need_c = counters.concurrency + 1 - plan.shared_concurrency
    need_k = counters.kv_tokens + kv - plan.shared_kv
    if need_c > counters.preemptible_concurrency or need_k > counters.preemptible_kv:
        return []
    victims: list[Lease] = []
    for lease in eviction_order(groups, order):
        if need_c <= 0 and need_k <= 0:
            break
        victims.append(lease)
        need_c -= 1
        need_k -= lease.kv_tokens
    return victims if need_c <= 0 and need_k <= 0 else []
