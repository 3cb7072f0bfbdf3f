"""What the core answers. Reason codes are a stable, documented contract (docs/decisions.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from tokenpools.control.store import Lease, Outcome, Shortfall
from tokenpools.control.views import EntitlementView, PoolView
from tokenpools.model.entitlement import BindingState


class Reason(StrEnum):
    UNKNOWN_ENTITLEMENT = "unknown_entitlement"
    ENTITLEMENT_PENDING = "entitlement_pending"
    ENTITLEMENT_DEGRADED = "entitlement_degraded"
    ENTITLEMENT_EXPIRED = "entitlement_expired"
    EXCEEDS_ENTITLEMENT = "exceeds_entitlement"  # could never fit, whatever the load
    EXCEEDS_POOL = "exceeds_pool"
    CONCURRENCY_LIMIT = "concurrency_limit"
    THROUGHPUT_LIMIT = "throughput_limit"
    KV_LIMIT = "kv_limit"
    LOW_PRIORITY = "low_priority"
    POOL_FULL = "pool_full"
    STORE_UNAVAILABLE = "store_unavailable"  # the shared store is unreachable: fail closed
    INSUFFICIENT_QUOTA = "insufficient_quota"  # a budget cannot take the request (OpenAI's code)


class Check(StrEnum):
    """Which admission step decided; the paper's five checks plus ours."""

    STATE = "state"  # paper check 1
    SIZE = "size"  # after check 2: the request with its max_tokens can never fit
    CONCURRENCY = "concurrency"  # paper check 3
    THROUGHPUT = "throughput"  # paper check 4
    KV = "kv"
    PRIORITY = "priority"  # paper check 5
    CAPACITY = "capacity"  # room in the pool, after eviction and overcommit
    BUDGET = "budget"  # a budget's window (control/budgets.py), checked before the rest


# What each failed comparison of the store's reserve means to a client.
SHORTFALL_REJECTS: dict[Shortfall, tuple[Reason, Check, str | None, str]] = {
    Shortfall.ENTITLEMENT_CONCURRENCY: (
        Reason.CONCURRENCY_LIMIT,
        Check.CONCURRENCY,
        None,
        "too many requests in flight for this entitlement",
    ),
    Shortfall.ENTITLEMENT_THROUGHPUT: (
        Reason.THROUGHPUT_LIMIT,
        Check.THROUGHPUT,
        None,
        "token throughput allocation exhausted",
    ),
    Shortfall.ENTITLEMENT_KV: (
        Reason.KV_LIMIT,
        Check.KV,
        None,
        "KV-cache allocation exhausted",
    ),
    Shortfall.LOW_PRIORITY: (
        Reason.LOW_PRIORITY,
        Check.PRIORITY,
        None,
        "pool is contended and this entitlement's priority is below the admission threshold",
    ),
    Shortfall.RESERVED_CONCURRENCY: (
        Reason.POOL_FULL,
        Check.CAPACITY,
        "concurrency",
        "the pool's free sequence slots are reserved for guaranteed and dedicated tenants",
    ),
    Shortfall.RESERVED_KV: (
        Reason.POOL_FULL,
        Check.CAPACITY,
        "kv_tokens",
        "the pool's free KV cache is reserved for guaranteed and dedicated tenants",
    ),
    Shortfall.RESERVED_THROUGHPUT: (
        Reason.POOL_FULL,
        Check.CAPACITY,
        "throughput",
        "the pool's free token throughput is reserved for guaranteed and dedicated tenants",
    ),
    Shortfall.POOL_CONCURRENCY: (
        Reason.POOL_FULL,
        Check.CAPACITY,
        "concurrency",
        "pool has no free sequence slot",
    ),
    Shortfall.POOL_KV: (Reason.POOL_FULL, Check.CAPACITY, "kv_tokens", "pool has no free KV cache"),
    Shortfall.POOL_THROUGHPUT: (
        Reason.POOL_FULL,
        Check.CAPACITY,
        "throughput",
        "pool token throughput exhausted",
    ),
}

STATE_REASONS = {
    BindingState.PENDING: Reason.ENTITLEMENT_PENDING,
    BindingState.DEGRADED: Reason.ENTITLEMENT_DEGRADED,
    BindingState.EXPIRED: Reason.ENTITLEMENT_EXPIRED,
}


@dataclass(frozen=True, slots=True)
class Quota:
    """An entitlement's limits and what is left of them after a decision, as OpenAI's
    x-ratelimit-* headers say them. In a dimension where the entitlement has no limit of its
    own, the pool's is shown (and what the whole pool has left)."""

    limit_requests: float  # requests in flight
    remaining_requests: float
    reset_requests_s: float  # until a slot is expected to be free; 0 while one is
    limit_tokens: float  # the token bucket's depth
    remaining_tokens: float
    reset_tokens_s: float  # until the bucket is full again

    # written out for mypyc (control/store_terms.py says why, above Lease)
    def __init__(
        self,
        limit_requests: float,
        remaining_requests: float,
        reset_requests_s: float,
        limit_tokens: float,
        remaining_tokens: float,
        reset_tokens_s: float,
    ) -> None:
        object.__setattr__(self, "limit_requests", limit_requests)
        object.__setattr__(self, "remaining_requests", remaining_requests)
        object.__setattr__(self, "reset_requests_s", reset_requests_s)
        object.__setattr__(self, "limit_tokens", limit_tokens)
        object.__setattr__(self, "remaining_tokens", remaining_tokens)
        object.__setattr__(self, "reset_tokens_s", reset_tokens_s)


# Admit and Reject are built on every request: frozen, with their __init__ written out for
# mypyc (control/store_terms.py says why, above Lease).
@dataclass(frozen=True, slots=True)
class Admit:
    lease: Lease
    priority: float
    evict: tuple[Lease, ...] = ()  # in-flight preemptible requests the host must terminate
    overcommit: bool = False
    max_tokens: int = 0  # what the reservation assumed: the request's, or the default
    quota: Quota | None = None  # from the counters the store read in the same step
    # the tightest budget after the admission: (name, what is left, its window's end; INF for
    # a lifetime budget); None when no budget applies
    budget: tuple[str, float, float] | None = None
    lowered: bool = False  # max_tokens was lowered to fit a budget: the host must send it

    # a property, not a field: mypyc lists even a ClassVar among a dataclass's fields, and
    # dataclasses.replace would then pass it to __init__
    @property
    def admitted(self) -> bool:
        return True

    def __init__(
        self,
        lease: Lease,
        priority: float,
        evict: tuple[Lease, ...] = (),
        overcommit: bool = False,
        max_tokens: int = 0,
        quota: Quota | None = None,
        budget: tuple[str, float, float] | None = None,
        lowered: bool = False,
    ) -> None:
        object.__setattr__(self, "lease", lease)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "evict", evict)
        object.__setattr__(self, "overcommit", overcommit)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "quota", quota)
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "lowered", lowered)


@dataclass(frozen=True, slots=True)
class Reject:
    reason: Reason
    check: Check
    message: str
    retry_after_s: float | None = None  # None: retrying the same request cannot succeed
    dimension: str | None = None  # for pool_full: concurrency, kv_tokens or throughput
    quota: Quota | None = None  # for a refusal of room; read from the store in the same step
    budget: str | None = None  # for insufficient_quota: the budget that refused
    max_tokens_fit: int = 0  # > 0: the budgets allow this request with max_tokens lowered to it

    @property
    def admitted(self) -> bool:
        return False

    def __init__(
        self,
        reason: Reason,
        check: Check,
        message: str,
        retry_after_s: float | None = None,
        dimension: str | None = None,
        quota: Quota | None = None,
        budget: str | None = None,
        max_tokens_fit: int = 0,
    ) -> None:
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "check", check)
        object.__setattr__(self, "message", message)
        object.__setattr__(self, "retry_after_s", retry_after_s)
        object.__setattr__(self, "dimension", dimension)
        object.__setattr__(self, "quota", quota)
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "max_tokens_fit", max_tokens_fit)


def quota(view: EntitlementView, pool_view: PoolView, outcome: Outcome) -> Quota | None:
    e, p = outcome.entitlement, outcome.pool
    if e is None or p is None:
        return None
    plan = view.plan
    if plan.ent_concurrency < math.inf:
        limit, used = plan.ent_concurrency, e.concurrency
    else:  # no limit of its own: the pool's (its plan's shared capacity)
        limit, used = plan.shared_concurrency, p.concurrency
    left = max(0.0, limit - used)
    own = view.own_bucket
    bucket, level = (own, e.bucket) if own.depth < math.inf else (pool_view.bucket, p.bucket)
    level = min(max(0.0, level), bucket.depth)
    refill = (bucket.depth - level) / bucket.rate if 0 < bucket.rate < math.inf else 0.0
    wait = 0.0 if left >= 1 else pool_view.mean_service_s
    return Quota(limit, left, wait, bucket.depth, level, refill)


Decision = Admit | Reject


@dataclass(frozen=True, slots=True)
class CapacityChange:
    evict: tuple[Lease, ...] = ()
    states: dict[str, BindingState] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TickResult:
    expired: tuple[Lease, ...] = ()
    updated_pools: tuple[str, ...] = ()  # pools whose debt/burst/priority were updated
    states_changed: dict[str, BindingState] = field(default_factory=dict)
