"""The embedded store's books: its pools' and entitlements' accounts, the leases in flight
with their expiry order, the budget windows and the usage ledger; how a lease is booked and
finished on all of them at once; and the reads (counters, windows, scores, usage). The Store
port's operations on them are in memory.py."""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Sequence

from tokenpools.control.eviction import refund_when_taken
from tokenpools.control.metering import BudgetHold, Charge, PendingUsage, UsageRow
from tokenpools.control.store import EntitlementCounters, Lease, PoolCounters, Scores, Window
from tokenpools.state.accounts import EntitlementAccount, PoolAccount
from tokenpools.state.metering import BudgetBook, UsageBook


class MemoryBook:
    def __init__(self) -> None:
        self._pools: dict[str, PoolAccount] = {}
        self._ents: dict[str, EntitlementAccount] = {}
        self._leases: dict[str, Lease] = {}
        self._expiry: list[tuple[float, str]] = []
        self._budgets = BudgetBook()
        # This store's life names its ledger rows: a restarted process counts anew beside them.
        self._usage = UsageBook(f"memory:{secrets.token_hex(6)}")

    # -- bookkeeping ---------------------------------------------------------------------

    def _book(self, lease: Lease, e: EntitlementAccount, p: PoolAccount, now: float) -> None:
        e.accumulate(now)
        e.concurrency += 1
        e.kv += lease.kv_tokens
        e.leases += 1
        p.concurrency += 1
        p.kv += lease.kv_tokens
        p.leases += 1
        if lease.preemptible:
            p.pre_concurrency += 1
            p.pre_kv += lease.kv_tokens
            p.reclaimable += refund_when_taken(lease)
            p.preemptible_by_ent.setdefault(lease.entitlement, {})[lease.lease_id] = lease
        if e.protected:
            self._update_holdback(e, p)
        e.peak_concurrency = max(e.peak_concurrency, e.concurrency)  # its claim's, backfill.py
        e.peak_kv = max(e.peak_kv, e.kv)
        self._update_claim(e, p)
        if not lease.reserved_path:
            count = p.inflight.get(e.name, 0)
            p.inflight[e.name] = count + 1
            if count == 0 and p.low is not None:
                heapq.heappush(p.low, (e.priority, e.name))
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))

    def _finish(
        self,
        lease: Lease,
        now: float,
        bucket_used: float,
        observed: float,
        charge: Charge | None = None,
        how: str = "settled",
    ) -> None:
        """End a lease: `bucket_used` of its tokens are spent, the rest refunded; `charge` (its
        whole reservation if None) goes to its budgets and ledger bucket."""
        del self._leases[lease.lease_id]
        if lease.meter is not None:
            self._charge(lease, now, charge, how)
        e = self._ents[lease.entitlement]
        p = self._pools[lease.pool]
        e.accumulate(now)
        e.concurrency -= 1
        e.kv -= lease.kv_tokens
        e.leases -= 1
        e.settled += observed
        p.concurrency -= 1
        p.kv -= lease.kv_tokens
        p.leases -= 1
        if lease.preemptible:
            p.pre_concurrency -= 1
            p.pre_kv -= lease.kv_tokens
            # none left: exactly 0, with no rounding residue
            p.reclaimable = p.reclaimable - refund_when_taken(lease) if p.pre_concurrency else 0.0
            group = p.preemptible_by_ent[lease.entitlement]
            del group[lease.lease_id]
            if not group:
                del p.preemptible_by_ent[lease.entitlement]
        if e.protected:
            self._update_holdback(e, p)
        self._update_claim(e, p)
        if not lease.reserved_path:
            count = p.inflight[e.name] - 1
            if count:
                p.inflight[e.name] = count
            else:
                del p.inflight[e.name]  # its heap entry goes stale and is dropped lazily
        refund = lease.tokens - bucket_used
        if refund:
            p.bucket.credit(refund, now)
            if lease.drew_own:
                e.own.credit(refund, now)
            if lease.reserved_path:
                p.protected_bucket.credit(refund, now)

    def _charge(self, lease: Lease, now: float, charge: Charge | None, how: str) -> None:
        meter = lease.meter
        assert meter is not None
        if charge is None:
            charge = meter.worst
        if meter.holds:
            self._budgets.charge(meter, charge)
        self._usage.ended(lease.pool, meter.bucket, now, charge, how, meter.worst)

    def recharge(self, lease: Lease, charge: Charge, now: float) -> None:
        meter = lease.meter
        if meter is None:
            return
        self._budgets.recharge(meter, charge)
        self._usage.recharged(lease.pool, meter.bucket, now, charge, meter.worst)

    @staticmethod
    def _update_holdback(e: EntitlementAccount, p: PoolAccount) -> None:
        hold_c = max(0.0, e.holdback_concurrency - e.concurrency)
        hold_k = max(0.0, e.holdback_kv - e.kv)
        p.held_concurrency += hold_c - e.held_concurrency
        p.held_kv += hold_k - e.held_kv
        e.held_concurrency, e.held_kv = hold_c, hold_k

    @staticmethod
    def _update_claim(e: EntitlementAccount, p: PoolAccount) -> None:
        claim_c = max(0.0, e.peak_recent_concurrency - e.concurrency)
        claim_k = max(0.0, e.peak_recent_kv - e.kv)
        p.claimed_concurrency += claim_c - e.claimed_concurrency
        p.claimed_kv += claim_k - e.claimed_kv
        p.claimed_sq_concurrency += claim_c * claim_c - e.claimed_concurrency**2
        p.claimed_sq_kv += claim_k * claim_k - e.claimed_kv**2
        e.claimed_concurrency, e.claimed_kv = claim_c, claim_k

    # -- reads: observation, scores, usage ---------------------------------------------

    def take_window(self, name: str, now: float) -> Window:
        return self._ents[name].take_window(now)

    def pending_usage(self, pool: str, now: float, limit: int) -> PendingUsage:
        return self._usage.pending(pool, limit)

    def ack_usage(self, pool: str, rows: Sequence[UsageRow], now: float) -> None:
        self._usage.ack(pool, rows)

    def budget_usage(
        self, holds: Sequence[BudgetHold], now: float
    ) -> list[tuple[float, float, bool]]:
        return self._budgets.usage([h.key for h in holds])

    def claim_notice(self, hold: BudgetHold, threshold: float, now: float) -> bool:
        return self._budgets.claim_notice(hold.key, threshold)

    def scores(self, name: str, now: float) -> Scores:
        e = self._ents[name]
        return Scores(e.debt, e.burst, e.priority, e.peak_recent_concurrency, e.peak_recent_kv)

    def set_scores(self, name: str, scores: Scores, now: float) -> None:
        e = self._ents[name]
        if e.priority != scores.priority:
            self._pools[e.pool].low = None
        e.debt, e.burst, e.priority = scores.debt, scores.burst, scores.priority
        e.peak_recent_concurrency, e.peak_recent_kv = scores.peak_concurrency, scores.peak_kv
        self._update_claim(e, self._pools[e.pool])

    def claim_update(self, pool: str, period: int, now: float) -> bool:
        p = self._pools[pool]
        if period <= p.last_period:
            return False
        p.last_period = period
        return True

    def pool_counters(self, pool: str, now: float) -> PoolCounters:
        return self._pools[pool].counters(now)

    def entitlement_counters(self, name: str, now: float) -> EntitlementCounters:
        e = self._ents[name]
        e.own.refill(now)
        return EntitlementCounters(e.concurrency, e.kv, e.own.level, e.leases)
