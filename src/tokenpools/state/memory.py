"""The embedded, single-process store: plain objects and dicts, no locks (one event loop)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import replace

from tokenpools.control.eviction import choose_victims, refund_when_taken
from tokenpools.control.metering import NO_CHARGE, Charge
from tokenpools.control.store import (
    ADMITTED,
    BucketSpec,
    Lease,
    Outcome,
    Reservation,
    ReservePlan,
    Shortfall,
)
from tokenpools.state.accounts import Bucket, EntitlementAccount, PoolAccount
from tokenpools.state.checks import first_shortfall
from tokenpools.state.memory_book import MemoryBook

_POOL_SHORTFALLS = frozenset(
    {Shortfall.POOL_CONCURRENCY, Shortfall.POOL_KV, Shortfall.POOL_THROUGHPUT}
)


class MemoryStore(MemoryBook):
    """The Store port on `MemoryBook`'s accounts: configuration, the atomic admission step,
    the ends of leases (the bookkeeping and the reads live in memory_book.py)."""

    def __init__(self, counters_on_admit: bool = False) -> None:
        """`counters_on_admit`: an admission's outcome carries the counters after it, as a
        refusal's always does (the gateway's x-ratelimit-* headers; the simulator needs none,
        and building them costs the admission path about a quarter of its time)."""
        super().__init__()
        self.counters_on_admit = counters_on_admit

    # -- configuration -------------------------------------------------------------------

    def configure_pool(
        self, pool: str, bucket: BucketSpec, protected_bucket: BucketSpec, now: float
    ) -> None:
        p = self._pools.get(pool)
        if p is None:
            self._pools[pool] = PoolAccount(Bucket(bucket, now), Bucket(protected_bucket, now))
            return
        p.bucket.reshape(bucket, now)
        p.protected_bucket.reshape(protected_bucket, now)
        self._resync_protected_bucket(pool, now)

    def configure_entitlement(
        self,
        name: str,
        pool: str,
        own_bucket: BucketSpec,
        holdback_concurrency: float,
        holdback_kv: float,
        now: float,
        protected: bool = False,
    ) -> None:
        e = self._ents.get(name)
        if e is None:
            e = self._ents[name] = EntitlementAccount(name, pool, Bucket(own_bucket, now), now)
        else:
            e.own.reshape(own_bucket, now)
        p = self._pools[pool]
        e.protected = protected
        if protected:
            p.protected.add(name)
        else:
            p.protected.discard(name)
        e.holdback_concurrency, e.holdback_kv = holdback_concurrency, holdback_kv
        self._update_holdback(e, p)
        self._resync_protected_bucket(pool, now)

    def _resync_protected_bucket(self, pool: str, now: float) -> None:
        # The aggregate must never be below Σ own levels, or borrowers could take what a
        # protected tenant is still owed.
        p = self._pools[pool]
        total = 0.0
        for name in p.protected:
            own = self._ents[name].own
            own.refill(now)
            total += max(0.0, own.level)
        agg = p.protected_bucket
        agg.refill(now)
        agg.level = max(min(agg.level, agg.depth), min(total, agg.depth))

    def remove_entitlement(self, name: str, now: float) -> list[Lease]:
        e = self._ents.get(name)
        if e is None:
            return []
        ended = [lease for lease in self._leases.values() if lease.entitlement == name]
        for lease in ended:
            self._finish(lease, now, bucket_used=lease.tokens, observed=0.0, how="released")
        p = self._pools[e.pool]
        e.holdback_concurrency = e.holdback_kv = 0.0
        self._update_holdback(e, p)
        e.peak_recent_concurrency = e.peak_recent_kv = 0.0
        self._update_claim(e, p)
        p.protected.discard(name)
        p.forget_refusals(name)
        del self._ents[name]
        return ended

    # -- the atomic step -----------------------------------------------------------------

    def admit(self, reservation: Reservation, now: float) -> Outcome:
        outcome = self._admit_metered(reservation, now)
        if outcome.shortfall is not None and (meter := reservation.lease.meter) is not None:
            self._usage.refused(reservation.lease.pool, meter.bucket, outcome.shortfall.value, now)
        return outcome

    def admit_first(self, reservations: Sequence[Reservation], now: float) -> list[Outcome]:
        tried = []
        for reservation in reservations:
            outcome = self._admit_metered(reservation, now)
            tried.append(outcome)
            if outcome.shortfall is None:
                return tried
        first = reservations[0].lease  # a refusal counts on the first layer, as in metrics
        if first.meter is not None and tried[0].shortfall is not None:
            self._usage.refused(first.pool, first.meter.bucket, tried[0].shortfall.value, now)
        return tried

    def _admit_metered(self, reservation: Reservation, now: float) -> Outcome:
        """Budgets first (a tenant stopped by its budget is owed nothing: no demand counted),
        then capacity; an admitted metered lease holds its worst case in every budget."""
        lease = reservation.lease
        if lease.lease_id in self._leases:
            raise ValueError(f"request id {lease.lease_id!r} already holds a lease")
        meter = lease.meter
        if meter is None or not meter.holds:
            return self._admit(reservation, now)
        budgets = self._budgets
        over = budgets.refusing(meter)
        if over >= 0:
            outcome = Outcome(
                Shortfall.BUDGET, budget_left=budgets.left(meter), budget_refused=over
            )
            return self._after(outcome, lease, now)
        outcome = self._admit(reservation, now)
        if outcome.shortfall is not None:  # refused for room: the budgets are not the news
            return outcome
        if outcome is ADMITTED:  # shared: never written to
            outcome = Outcome(None)
        outcome.budget_left = budgets.hold(meter)
        return outcome

    def _admit(self, reservation: Reservation, now: float) -> Outcome:
        lease, plan, share = reservation.lease, reservation.plan, reservation.claim_share
        short = self._reserve(lease, plan, now, demand=reservation.demand, claim_share=share)
        if short is None:
            return self._after(Outcome(None), lease, now) if self.counters_on_admit else ADMITTED
        if short in _POOL_SHORTFALLS and reservation.victim_count:
            victims = choose_victims(
                self.pool_counters(lease.pool, now),
                plan,
                lease.kv_tokens,
                lease.tokens,
                self._pools[lease.pool].preemptible_by_ent,
                reservation.victims[: reservation.victim_count],
            )
            ids = [v.lease_id for v in victims]
            if victims and self._reserve(lease, plan, now, evict=ids, claim_share=share) is None:
                return self._admitted(Outcome(None, evicted=tuple(victims)), lease, now)
        if (
            reservation.may_overcommit
            and short in _POOL_SHORTFALLS
            and self._reserve(lease, plan, now, overcommit=True, claim_share=share) is None
        ):
            return self._admitted(Outcome(None, overcommit=True), lease, now)
        return self._after(Outcome(short), lease, now)

    def _admitted(self, outcome: Outcome, lease: Lease, now: float) -> Outcome:
        return self._after(outcome, lease, now) if self.counters_on_admit else outcome

    def _after(self, outcome: Outcome, lease: Lease, now: float) -> Outcome:
        """The counters after the step: a refusal's Retry-After and every answer's rate-limit
        headers are computed from them."""
        outcome.entitlement = self.entitlement_counters(lease.entitlement, now)
        outcome.pool = self.pool_counters(lease.pool, now)
        return outcome

    def _reserve(
        self,
        lease: Lease,
        plan: ReservePlan,
        now: float,
        overcommit: bool = False,
        evict: Sequence[str] = (),
        demand: float = 0.0,
        claim_share: float = 0.0,
    ) -> Shortfall | None:
        e = self._ents[lease.entitlement]
        p = self._pools[lease.pool]
        e.demand += demand
        # Victims are checked as if already gone, and ended only if the reservation succeeds.
        victims = [
            v
            for v in map(self._leases.get, evict)
            if v is not None and v.preemptible and v.pool == lease.pool
        ]
        short = first_shortfall(
            lease, plan, e, p, self._ents, victims, now, overcommit, claim_share
        )
        if short is not None:
            return short
        for victim in victims:
            self.take_back(victim.lease_id, now)
        p.bucket.level -= lease.tokens
        e.admitted += lease.tokens
        self._book(lease, e, p, now)
        return None

    # -- ending leases -------------------------------------------------------------------

    def settle(
        self, lease_id: str, used_tokens: float, now: float, charge: Charge | None = None
    ) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            if charge is None:
                charge = Charge(tokens=used_tokens)
            self._finish(lease, now, used_tokens, used_tokens, charge)
        return lease

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            used, charge = (0.0, NO_CHARGE) if refund else (lease.tokens, None)
            self._finish(lease, now, used, 0.0, charge, how="released")
        return lease

    def take_back(self, lease_id: str, now: float) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            used = lease.tokens - refund_when_taken(lease)
            self._finish(lease, now, bucket_used=used, observed=0.0, how="evicted")
        return lease

    def adopt(self, lease: Lease, now: float) -> bool:
        """Book a lease admitted elsewhere, with no checks (the request is already running):
        charged to the pool bucket like a shared-path lease. False if it is already here."""
        if lease.lease_id in self._leases:
            return False
        e = self._ents.get(lease.entitlement)
        if e is None:
            return False
        p = self._pools[lease.pool]
        lease = replace(lease, reserved_path=False, drew_own=False)
        p.bucket.refill(now)
        p.bucket.level -= lease.tokens
        e.admitted += lease.tokens
        self._book(lease, e, p, now)
        return True

    def renew(self, lease_id: str, expires_at: float, now: float) -> bool:
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.expires_at = expires_at
        heapq.heappush(self._expiry, (expires_at, lease_id))
        return True

    def expire(self, now: float) -> list[Lease]:
        """End every lease past its expiry. Its tokens count as spent: nobody reported usage."""
        ended = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            expires_at, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at == expires_at:
                self._finish(lease, now, lease.tokens, 0.0, how="expired")
                ended.append(lease)
        if not self._leases:
            heap.clear()  # drop stale entries of settled leases
        self._budgets.forget_past(now)
        return ended

    def get_lease(self, lease_id: str, now: float) -> Lease | None:
        return self._leases.get(lease_id)

    @property
    def leases(self) -> Mapping[str, Lease]:
        """Every lease in flight, by id. A read-only view: do not mutate."""
        return self._leases

    def preemptible_leases(self, pool: str, now: float) -> Mapping[str, Mapping[str, Lease]]:
        return self._pools[pool].preemptible_by_ent

    def resumable_leases(self, pool: str, now: float) -> Mapping[str, Mapping[str, Lease]]:
        groups: dict[str, dict[str, Lease]] = {}
        for lease in sorted(self._leases.values(), key=lambda v: (v.started_at, v.lease_id)):
            if lease.pool == pool and lease.resumable:
                groups.setdefault(lease.entitlement, {})[lease.lease_id] = lease
        return groups
