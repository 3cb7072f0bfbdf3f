"""What a store reports of its state: a pool's and an entitlement's counters (why a request
was refused, the snapshot), an entitlement's usage `Window` over an update period, and the
`Scores` the periodic update keeps (debt, burst, claim). control/store.py has the port."""

from __future__ import annotations

from dataclasses import dataclass


# Counter snapshots are built on every rejected request: mutable slotted classes with their
# __init__ written out (as Lease's). Treat them as read-only.
@dataclass(slots=True)
class PoolCounters:
    concurrency: float  # reserved by in-flight leases
    kv_tokens: float
    preemptible_concurrency: float
    preemptible_kv: float
    holdback_concurrency: float  # Σ unused baselines of protected entitlements
    holdback_kv: float
    bucket: float  # pool token-bucket level
    protected_bucket: float  # Σ of protected entitlements' unspent allowance
    leases: int
    # Σ max(0, claim − in flight): what the others are expected to take back soon, which
    # surplus work leaves free (control/backfill.py)
    claimed_concurrency: float = 0.0
    claimed_kv: float = 0.0
    # Σ tokens taking back the lent work in flight would give back to the bucket
    reclaimable_tokens: float = 0.0

    def __init__(
        self,
        concurrency: float,
        kv_tokens: float,
        preemptible_concurrency: float,
        preemptible_kv: float,
        holdback_concurrency: float,
        holdback_kv: float,
        bucket: float,
        protected_bucket: float,
        leases: int,
        claimed_concurrency: float = 0.0,
        claimed_kv: float = 0.0,
        reclaimable_tokens: float = 0.0,
    ) -> None:
        self.concurrency, self.kv_tokens = concurrency, kv_tokens
        self.preemptible_concurrency, self.preemptible_kv = preemptible_concurrency, preemptible_kv
        self.holdback_concurrency, self.holdback_kv = holdback_concurrency, holdback_kv
        self.bucket, self.protected_bucket, self.leases = bucket, protected_bucket, leases
        self.claimed_concurrency, self.claimed_kv = claimed_concurrency, claimed_kv
        self.reclaimable_tokens = reclaimable_tokens


@dataclass(slots=True)
class EntitlementCounters:
    concurrency: float
    kv_tokens: float
    bucket: float
    leases: int

    def __init__(self, concurrency: float, kv_tokens: float, bucket: float, leases: int) -> None:
        self.concurrency, self.kv_tokens, self.bucket, self.leases = (
            concurrency,
            kv_tokens,
            bucket,
            leases,
        )


@dataclass(frozen=True, slots=True)
class Window:
    """Usage observed over one update period, read and reset in one step."""

    seconds: float
    settled_tokens: float
    demand_tokens: float  # requested, admitted or not
    admitted_tokens: float  # reserved at admission (n_in + max_tokens, weighted)
    concurrency_seconds: float  # ∫ in-flight dt
    kv_seconds: float  # ∫ reserved KV dt
    # the most in flight at once during the period; kept for protected entitlements only
    peak_concurrency: float = 0.0
    peak_kv: float = 0.0

    def __init__(
        self,
        seconds: float,
        settled_tokens: float,
        demand_tokens: float,
        admitted_tokens: float,
        concurrency_seconds: float,
        kv_seconds: float,
        peak_concurrency: float = 0.0,
        peak_kv: float = 0.0,
    ) -> None:
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "settled_tokens", settled_tokens)
        object.__setattr__(self, "demand_tokens", demand_tokens)
        object.__setattr__(self, "admitted_tokens", admitted_tokens)
        object.__setattr__(self, "concurrency_seconds", concurrency_seconds)
        object.__setattr__(self, "kv_seconds", kv_seconds)
        object.__setattr__(self, "peak_concurrency", peak_concurrency)
        object.__setattr__(self, "peak_kv", peak_kv)


@dataclass(frozen=True, slots=True)
class Scores:
    debt: float = 0.0
    burst: float = 0.0
    priority: float = 0.0
    # The entitlement's claim (control/backfill.py): the in flight it is expected to come back
    # to soon, which surplus work (spot, preemptible) leaves free.
    peak_concurrency: float = 0.0
    peak_kv: float = 0.0

    def __init__(
        self,
        debt: float = 0.0,
        burst: float = 0.0,
        priority: float = 0.0,
        peak_concurrency: float = 0.0,
        peak_kv: float = 0.0,
    ) -> None:
        object.__setattr__(self, "debt", debt)
        object.__setattr__(self, "burst", burst)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "peak_concurrency", peak_concurrency)
        object.__setattr__(self, "peak_kv", peak_kv)
