"""The paper's comparisons of one lease against a ReservePlan, on the memory store's accounts
(state/redis/lua/reserve.lua's `attempt` is their port), in the order the Shortfall enum lists
them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenpools.control.backfill import kv_kept, slots_kept
from tokenpools.control.eviction import refund_when_taken
from tokenpools.control.store import Lease, ReservePlan, Shortfall
from tokenpools.state.accounts import EntitlementAccount, PoolAccount


def first_shortfall(
    lease: Lease,
    plan: ReservePlan,
    e: EntitlementAccount,
    p: PoolAccount,
    ents: Mapping[str, EntitlementAccount],
    victims: Sequence[Lease],
    now: float,
    overcommit: bool,
    claim_share: float = 0.0,
) -> Shortfall | None:
    """The first comparison the lease fails, `victims` counted as gone (a refusal for room is
    noted for check 5); None if it fits, with its own and protected buckets debited and its
    path set on the lease. Booking it is the caller's."""
    tokens, kv = lease.tokens, lease.kv_tokens
    used_c, used_k, pre_c, pre_k = p.concurrency, p.kv, p.pre_concurrency, p.pre_kv
    conc_after = e.concurrency + 1
    if conc_after > plan.ent_concurrency:
        return Shortfall.ENTITLEMENT_CONCURRENCY
    own = e.own
    own.refill(now)
    own_ok = own.level >= tokens
    if plan.own_required and not own_ok:
        return Shortfall.ENTITLEMENT_THROUGHPUT
    kv_after = e.kv + kv
    if kv_after > plan.ent_kv:
        return Shortfall.ENTITLEMENT_KV
    within = own_ok and conc_after <= plan.base_concurrency and kv_after <= plan.base_kv
    if victims and e.protected and not within:  # the pool owes it nothing beyond its baseline
        return Shortfall.POOL_CONCURRENCY
    bucket = p.bucket
    bucket.refill(now)
    level, reclaimable = bucket.level, p.reclaimable
    for victim in victims:
        used_c -= 1
        pre_c -= 1
        used_k -= victim.kv_tokens
        pre_k -= victim.kv_tokens
        refund = refund_when_taken(victim)
        level += refund
        reclaimable -= refund
    level = min(level, bucket.depth)
    pbucket = p.protected_bucket
    pbucket.refill(now)

    if within:
        if overcommit:
            lc, lk, lf = (
                plan.overcommit_concurrency,
                plan.overcommit_kv,
                plan.overcommit_bucket_floor,
            )
        else:
            lc, lk, lf = plan.reserved_concurrency, plan.reserved_kv, plan.reserved_bucket_floor
        short = None
        if used_c + 1 > lc:
            short = Shortfall.POOL_CONCURRENCY
        elif used_k + kv > lk:
            short = Shortfall.POOL_KV
        elif level - tokens < lf:
            short = Shortfall.POOL_THROUGHPUT
        if short is not None:
            p.note_refusal(e.name, e.priority, now)
            return short
        own.level -= tokens
        pbucket.level -= tokens
        lease.reserved_path = lease.drew_own = True
    else:
        hold_c, hold_k = p.held_concurrency, p.held_kv
        # What the bucket holds beyond the protected share. Lent work's tokens are spent, as
        # its slots are used, in what makes the pool contended; but the share counts as kept
        # as far as the lent work in flight would give it back when taken back.
        spare = level - pbucket.level - tokens
        unreserved = spare + reclaimable
        if (
            used_c + hold_c + 1 > plan.contended_concurrency
            or used_k + hold_k + kv > plan.contended_kv
            or spare < plan.contended_bucket
        ) and p.outranked(
            e.name,
            e.priority * plan.priority_margin,
            now - plan.contention_window_s,
            ents,
            lease.preemptible,
        ):
            p.note_refusal(e.name, e.priority, now)
            return Shortfall.LOW_PRIORITY
        # What is held for protected baselines first: evicting preemptible work cannot
        # help there (its plan limit is infinite for preemptible requests).
        short = None
        if used_c - pre_c + hold_c + 1 > plan.nonpreemptible_concurrency:
            short = Shortfall.RESERVED_CONCURRENCY
        elif used_k - pre_k + hold_k + kv > plan.nonpreemptible_kv:
            short = Shortfall.RESERVED_KV
        elif unreserved < plan.nonpreemptible_bucket_floor:
            short = Shortfall.RESERVED_THROUGHPUT
        if short is not None:
            # Where only the unused baselines stop it, lent work may run there and leave this
            # request no less: its refusal then counts in check 5 against work not lent only.
            # Not so for tokens: lent work spends them from the same unreserved allowance.
            full = (
                short is Shortfall.RESERVED_THROUGHPUT
                or used_c + 1 > plan.shared_concurrency
                or used_k + kv > plan.shared_kv
                or level - tokens < plan.shared_bucket_floor
            )
            p.note_refusal(e.name, e.priority, now, reserved_only=not full)
            return short
        # Surplus work leaves its share of what the others are expected to claim back free.
        if (
            plan.surplus
            and used_c
            + 1
            + slots_kept(claim_share, p.claimed_concurrency, p.claimed_sq_concurrency)
            > plan.shared_concurrency
        ):
            short = Shortfall.RESERVED_CONCURRENCY
        elif (
            plan.surplus
            and used_k + kv + kv_kept(claim_share, p.claimed_kv, p.claimed_sq_kv) > plan.shared_kv
        ):
            short = Shortfall.RESERVED_KV
        elif used_c + 1 > plan.shared_concurrency:
            short = Shortfall.POOL_CONCURRENCY
        elif used_k + kv > plan.shared_kv:
            short = Shortfall.POOL_KV
        elif level - tokens < plan.shared_bucket_floor:
            short = Shortfall.POOL_THROUGHPUT
        if short is not None:
            p.note_refusal(e.name, e.priority, now)
            return short
        if plan.own_required:
            own.level -= tokens
            lease.drew_own = True
    return None
