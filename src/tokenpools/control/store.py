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
from typing import Protocol

from tokenpools.control.metering import BudgetHold, Charge, PendingUsage, UsageRow
from tokenpools.control.store_reads import EntitlementCounters, PoolCounters, Scores, Window
from tokenpools.control.store_terms import (
    ADMITTED,
    INF,
    BucketSpec,
    Lease,
    Outcome,
    Reservation,
    ReservePlan,
    Shortfall,
)

__all__ = [
    "ADMITTED",
    "INF",
    "BucketSpec",
    "EntitlementCounters",
    "Lease",
    "Outcome",
    "PoolCounters",
    "Reservation",
    "ReservePlan",
    "Scores",
    "Shortfall",
    "Store",
    "StoreUnavailable",
    "Window",
]


class StoreUnavailable(Exception):
    """The shared store did not answer in time. Whether the call took effect is unknown: a
    reservation it made without telling us expires with its lease."""


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

    def take_back(self, lease_id: str, now: float) -> Lease | None:
        """End a lease the core takes back outside an admission (a capacity loss), as
        admission ends its victims: its whole reservation charged to its budgets (the host
        recharges a suspended one what its client received), and to the pool bucket all but
        what taking it back gives back (control/eviction.py `refund_when_taken`)."""
        ...

    def recharge(self, lease: Lease, charge: Charge, now: float) -> None:
        """A metered lease that ended on its worst case because it was taken back before its
        usage was known (an eviction the host turned into a suspension) is charged `charge`
        instead: each budget counts what `charge` counts where it counted the worst case
        (`budget_refund`: never more; a window given room back is no longer marked spent), and
        the ledger bucket records the difference in the hour of `now`. The host that held the
        lease calls it once; nothing checks that it ended, so a second call would give back
        twice."""
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

    def resumable_leases(self, pool: str, now: float) -> Mapping[str, Mapping[str, Lease]]:
        """In-flight leases whose host suspends them when taken back (`Lease.resumable`), by
        entitlement, then by id, oldest first (by start, then id: the same order on every
        store); read when capacity is lost, never on the admission path."""
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
