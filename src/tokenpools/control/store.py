"""The store port: what the decision core keeps between events, and the words it uses.

The core owns this contract; state/ implements it (in memory, or in Redis for several gateway
replicas) and hosts choose which store the core gets. The one capacity-changing step, `admit`,
runs a whole admission atomically: the paper's checks against the numbers of a `ReservePlan`,
the choice of preemptible victims, the overcommit retry, and the counters a refusal is explained
with, so a shared store answers it in one round trip. The plan is plain numbers that control/
computed from the config. Everything else (settle, release, expiry, windows, scores) touches one
lease or one entitlement at a time. Every method takes `now`: no store keeps a clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from tokenpools.control.metering import BudgetHold, Charge, Meter, PendingUsage, UsageRow

INF = float("inf")


class StoreUnavailable(Exception):
    """The shared store did not answer in time. Whether the call took effect is unknown: a
    reservation it made without telling us expires with its lease."""


class Shortfall(StrEnum):
    """Which comparison of an admission failed, in the order they are made."""

    ENTITLEMENT_CONCURRENCY = "entitlement_concurrency"  # paper check 3
    ENTITLEMENT_THROUGHPUT = "entitlement_throughput"  # paper check 4
    ENTITLEMENT_KV = "entitlement_kv"
    LOW_PRIORITY = "low_priority"  # paper check 5: contended and below the threshold
    RESERVED_CONCURRENCY = "reserved_concurrency"  # the rest is held for protected baselines
    RESERVED_KV = "reserved_kv"
    RESERVED_THROUGHPUT = "reserved_throughput"
    POOL_CONCURRENCY = "pool_concurrency"  # the pool itself is full
    POOL_KV = "pool_kv"
    POOL_THROUGHPUT = "pool_throughput"
    BUDGET = "budget"  # a budget's window cannot hold the request's worst case (checked first)


# The values built on every request (this module's, Charge, Pending, the decisions) and in
# every tick (Window, Scores, Observation, Resources) write their __init__ out: mypyc compiles
# it (~25 ns), where the one @dataclass generates runs interpreted (~150 ns; ~370 ns when
# frozen, which a written one keeps with object.__setattr__). tests/test_value_classes.py
# checks that each takes its fields, in order, with their defaults.
@dataclass(slots=True)
class Lease:
    """One admitted request's reservation. It ends by settle, release, eviction or expiry."""

    lease_id: str
    pool: str
    entitlement: str
    tokens: float  # weighted throughput tokens reserved (n_in + max_tokens by default)
    kv_tokens: float
    started_at: float
    expires_at: float
    preemptible: bool
    reserved_path: bool = False  # booked against its protected baseline (set by reserve)
    drew_own: bool = False  # took its tokens from the entitlement's own bucket (set by reserve)
    meter: Meter | None = None  # budgets and usage ledger; None: neither

    def __init__(
        self,
        lease_id: str,
        pool: str,
        entitlement: str,
        tokens: float,
        kv_tokens: float,
        started_at: float,
        expires_at: float,
        preemptible: bool,
        reserved_path: bool = False,
        drew_own: bool = False,
        meter: Meter | None = None,
    ) -> None:
        self.lease_id, self.pool, self.entitlement = lease_id, pool, entitlement
        self.tokens, self.kv_tokens = tokens, kv_tokens
        self.started_at, self.expires_at = started_at, expires_at
        self.preemptible, self.reserved_path, self.drew_own = preemptible, reserved_path, drew_own
        self.meter = meter


@dataclass(frozen=True, slots=True)
class BucketSpec:
    rate: float  # tokens per second; INF means "no bucket"
    depth: float


@dataclass(frozen=True, slots=True)
class ReservePlan:
    """Per-entitlement limits, recomputed by control/ when config or capacity changes.

    A request *within* the protected baseline (base_* and the own bucket) takes the reserved
    path: it may use the whole pool (`reserved_*`), evict preemptible work and skips the
    priority threshold. Every other request takes the shared path: non-preemptible work must
    leave the unused protected baselines alone (`nonpreemptible_*`), surplus work also the
    others' open claims (`surplus`), and it passes check 5 when the pool is contended.
    """

    ent_concurrency: float  # in-flight ceiling (baseline, or burst ceiling)
    ent_kv: float
    own_required: bool  # the own bucket is a hard throughput ceiling
    base_concurrency: float  # a request within these takes the reserved path (0: never)
    base_kv: float
    reserved_concurrency: float  # pool total after admission, reserved path
    reserved_kv: float
    reserved_bucket_floor: float  # pool bucket level after admission, reserved path
    overcommit_concurrency: float  # the same three, when overcommit is allowed
    overcommit_kv: float
    overcommit_bucket_floor: float
    shared_concurrency: float  # pool total after admission, shared path
    shared_kv: float
    nonpreemptible_concurrency: float  # non-preemptible + unused protected baselines, shared path
    nonpreemptible_kv: float
    # spot and preemptible work: leave the reservation's share of the pool's open claims free
    # (control/backfill.py)
    surplus: bool
    shared_bucket_floor: float  # pool bucket level after admission
    nonpreemptible_bucket_floor: float  # pool bucket minus protected bucket after admission
    contended_concurrency: float  # used + unused protected baselines above this: contended
    contended_kv: float
    contended_bucket: float  # pool minus protected bucket below this: contended
    contention_window_s: float  # a refusal this recent counts as unmet demand
    # check 5 compares the request's priority × this: within it, priorities count as equal
    priority_margin: float


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
    ) -> None:
        self.concurrency, self.kv_tokens = concurrency, kv_tokens
        self.preemptible_concurrency, self.preemptible_kv = preemptible_concurrency, preemptible_kv
        self.holdback_concurrency, self.holdback_kv = holdback_concurrency, holdback_kv
        self.bucket, self.protected_bucket, self.leases = bucket, protected_bucket, leases
        self.claimed_concurrency, self.claimed_kv = claimed_concurrency, claimed_kv


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


@dataclass(slots=True)
class Reservation:
    """One admission as the store runs it, in one atomic step."""

    lease: Lease
    plan: ReservePlan
    demand: float  # tokens added to the entitlement's demand window, admitted or not
    # The first `victim_count` of `victims` are the entitlements whose preemptible leases may
    # be ended to make room, in eviction order (lowest priority first; within one, the newest
    # lease first). A count, not a copy: the pool's order is shared by every admission.
    victims: Sequence[str]
    victim_count: int
    may_overcommit: bool  # a protected request may lend past a full pool
    claim_share: float  # surplus work: the part of the pool's open claims to leave free


@dataclass(slots=True)
class Outcome:
    """What the store did with a `Reservation`."""

    shortfall: Shortfall | None  # None: admitted (lease.reserved_path and drew_own are set)
    # The counters after the step, which Retry-After and the rate-limit headers are computed
    # from: always after a refusal; after an admission where the host asked for them.
    entitlement: EntitlementCounters | None = None
    pool: PoolCounters | None = None
    evicted: tuple[Lease, ...] = ()  # preemptible leases ended to admit this one
    overcommit: bool = False
    # For a metered lease: each hold's limit minus what is used and held after the step; on a
    # BUDGET refusal, the first hold that could not take the worst case.
    budget_left: tuple[float, ...] = ()
    budget_refused: int = -1

    def __init__(
        self,
        shortfall: Shortfall | None,
        entitlement: EntitlementCounters | None = None,
        pool: PoolCounters | None = None,
        evicted: tuple[Lease, ...] = (),
        overcommit: bool = False,
        budget_left: tuple[float, ...] = (),
        budget_refused: int = -1,
    ) -> None:
        self.shortfall, self.entitlement, self.pool = shortfall, entitlement, pool
        self.evicted, self.overcommit = evicted, overcommit
        self.budget_left, self.budget_refused = budget_left, budget_refused


ADMITTED = Outcome(None)  # a plain admission without counters, shared: treat it as read-only


class Store(Protocol):
    def configure_pool(
        self, pool: str, bucket: BucketSpec, protected_bucket: BucketSpec, now: float
    ) -> None: ...

    def configure_entitlement(
        self,
        name: str,
        pool: str,
        own_bucket: BucketSpec,
        holdback_concurrency: float,
        holdback_kv: float,
        now: float,
        protected: bool = False,
    ) -> None: ...

    def remove_entitlement(self, name: str, now: float) -> list[Lease]: ...

    def admit(self, reservation: Reservation, now: float) -> Outcome:
        """Check the lease against the plan and book it, atomically. Failing on the pool's
        concurrency or KV, it tries again counting the chosen victims as gone (they end only if
        that succeeds); failing on the pool with `may_overcommit`, it tries the overcommit
        limits. The refusal reported is the first attempt's."""
        ...

    def admit_first(self, reservations: Sequence[Reservation], now: float) -> list[Outcome]:
        """Layered entitlements of one request, in one atomic step: each reservation (one
        lease id, one pool) is tried as `admit` tries it, in order, until one is admitted.
        Returns the outcomes of those tried; the last is the admission, if any."""
        ...

    def settle(
        self, lease_id: str, used_tokens: float, now: float, charge: Charge | None = None
    ) -> Lease | None:
        """End a lease on what it used: `used_tokens` of its buckets, and `charge` (default:
        those tokens alone) against its budgets and ledger bucket."""
        ...

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        """End a lease without usage: refunded (nothing charged), or charged its whole
        reservation (buckets, budgets and ledger alike), as expiry and eviction charge."""
        ...

    def renew(self, lease_id: str, expires_at: float, now: float) -> bool: ...

    def adopt(self, lease: Lease, now: float) -> bool:
        """Book a lease admitted elsewhere (a replica's local fallback while the store was
        unreachable) with no checks; False if the store already holds it."""
        ...

    def expire(self, now: float) -> list[Lease]: ...

    def get_lease(self, lease_id: str, now: float) -> Lease | None: ...

    def preemptible_leases(self, pool: str, now: float) -> Mapping[str, Mapping[str, Lease]]:
        """In-flight preemptible leases by entitlement, then by id, oldest first; only
        entitlements with leases appear. A read-only view: do not mutate."""
        ...

    def take_window(self, name: str, now: float) -> Window: ...

    def pending_usage(self, pool: str, now: float, limit: int) -> PendingUsage:
        """The usage-ledger rows of a pool's entitlements changed since they were last
        acknowledged (by any replica), oldest first, with their totals. Reading changes
        nothing: a row stays pending until `ack_usage` says it is committed."""
        ...

    def ack_usage(self, pool: str, rows: Sequence[UsageRow], now: float) -> None:
        """These rows are committed to SQL: each stops being pending unless its bucket changed
        since (a newer version), which is then written next time."""
        ...

    def budget_usage(
        self, holds: Sequence[BudgetHold], now: float
    ) -> list[tuple[float, float, bool]]:
        """(used, held, refused) of each budget window's counter (refused: a request did not
        fit in it); (0, 0, False) for one never touched."""
        ...

    def claim_notice(self, hold: BudgetHold, threshold: float, now: float) -> bool:
        """True once per budget window and threshold, across every replica."""
        ...

    def scores(self, name: str, now: float) -> Scores: ...

    def set_scores(self, name: str, scores: Scores, now: float) -> None: ...

    def claim_update(self, pool: str, period: int, now: float) -> bool: ...

    def pool_counters(self, pool: str, now: float) -> PoolCounters: ...

    def entitlement_counters(self, name: str, now: float) -> EntitlementCounters: ...
