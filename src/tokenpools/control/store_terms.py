"""The words of the store port for one admission: what the core asks (`Reservation`: a
`Lease` to hold, under a `ReservePlan` of plain numbers with its `BucketSpec`s) and what the
store answers (`Outcome`, and the `Shortfall` that explains a refusal). control/store.py has
the port itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from tokenpools.control.metering import Meter
from tokenpools.control.store_reads import EntitlementCounters, PoolCounters

INF = float("inf")


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
    # taking it back suspends it (its host resumes it later) rather than ending it: lent work,
    # and elastic work after a capacity loss (control/eviction.py `elastic_to_take_back`),
    # that the host can resume
    resumable: bool = False

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
        resumable: bool = False,
    ) -> None:
        self.lease_id, self.pool, self.entitlement = lease_id, pool, entitlement
        self.tokens, self.kv_tokens = tokens, kv_tokens
        self.started_at, self.expires_at = started_at, expires_at
        self.preemptible, self.reserved_path, self.drew_own = preemptible, reserved_path, drew_own
        self.meter = meter
        self.resumable = resumable


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
    # pool bucket + what lent work in flight would give back (PoolCounters.reclaimable_tokens)
    # − protected bucket, after admission; every shared-path request, lent or not
    nonpreemptible_bucket_floor: float
    contended_concurrency: float  # used + unused protected baselines above this: contended
    contended_kv: float
    contended_bucket: float  # pool minus protected bucket below this: contended
    contention_window_s: float  # a refusal this recent counts as unmet demand
    # check 5 compares the request's priority × this: within it, priorities count as equal
    priority_margin: float


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
