"""Retry-After: the expected time until this request's cost fits, jittered, clamped."""

from __future__ import annotations

import zlib

from tokenpools.control.store import (
    INF,
    BucketSpec,
    EntitlementCounters,
    PoolCounters,
    ReservePlan,
    Shortfall,
)
from tokenpools.model.policy import Policy


def expected_wait_s(
    shortfall: Shortfall,
    tokens: float,
    kv_tokens: float,
    plan: ReservePlan,
    pool: PoolCounters,
    ent: EntitlementCounters,
    pool_bucket: BucketSpec,
    own_bucket: BucketSpec,
    mean_service_s: float,
    until_next_update_s: float,
) -> float:
    """Little's law on the leases in flight (n of them complete at about n / mean_service_s per
    second, freeing their KV with them) and bucket refill for throughput."""
    if shortfall == Shortfall.ENTITLEMENT_CONCURRENCY:
        return mean_service_s / max(1.0, ent.concurrency)
    if shortfall in (Shortfall.POOL_CONCURRENCY, Shortfall.RESERVED_CONCURRENCY):
        return mean_service_s / max(1.0, pool.concurrency)
    if shortfall == Shortfall.ENTITLEMENT_KV:
        missing = ent.kv_tokens + kv_tokens - plan.ent_kv
        return missing * mean_service_s / max(1.0, ent.kv_tokens)
    if shortfall == Shortfall.POOL_KV:
        missing = pool.kv_tokens + kv_tokens - plan.shared_kv
        return missing * mean_service_s / max(1.0, pool.kv_tokens)
    if shortfall == Shortfall.RESERVED_KV:
        held = pool.kv_tokens - pool.preemptible_kv + pool.holdback_kv
        missing = held + kv_tokens - plan.nonpreemptible_kv
        return missing * mean_service_s / max(1.0, pool.kv_tokens)
    if shortfall == Shortfall.ENTITLEMENT_THROUGHPUT:
        return _refill_s(tokens - ent.bucket, own_bucket.rate)
    if shortfall == Shortfall.POOL_THROUGHPUT:
        return _refill_s(tokens - pool.bucket, pool_bucket.rate)
    if shortfall == Shortfall.RESERVED_THROUGHPUT:
        unreserved = (
            pool.bucket
            + pool.reclaimable_tokens
            - pool.protected_bucket
            - plan.nonpreemptible_bucket_floor
        )
        return _refill_s(tokens - unreserved, pool_bucket.rate)
    # Low priority: the answer changes when priorities are next updated or a slot frees up.
    return max(until_next_update_s, mean_service_s / max(1.0, pool.concurrency))


def _refill_s(missing: float, rate: float) -> float:
    if missing <= 0:
        return 0.0
    return INF if rate <= 0 else missing / rate


def jittered(wait_s: float, request_id: str, policy: Policy) -> float:
    """Spread retries ± jitter so rejected clients do not return as a herd. The jitter comes
    from the request id, so decisions stay deterministic for a given input."""
    u = zlib.crc32(request_id.encode()) / 0xFFFFFFFF
    wait = wait_s * (1.0 + policy.retry_after_jitter * (2.0 * u - 1.0))
    return max(policy.retry_after_min_s, min(policy.retry_after_max_s, wait))
