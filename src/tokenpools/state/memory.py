"""The embedded, single-process store: plain objects and dicts, no locks (one event loop)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import replace

from tokenpools.state.base import (
    INF,
    BucketSpec,
    EntitlementCounters,
    Lease,
    PoolCounters,
    ReservePlan,
    Scores,
    Shortfall,
    Window,
)


class _Bucket:
    __slots__ = ("depth", "level", "rate", "t")

    def __init__(self, spec: BucketSpec, now: float) -> None:
        self.rate = spec.rate
        self.depth = spec.depth
        self.level = spec.depth
        self.t = now

    def refill(self, now: float) -> None:
        dt = now - self.t
        if dt > 0:
            self.t = now
            level = self.level + self.rate * dt
            self.level = level if level < self.depth else self.depth

    def reshape(self, spec: BucketSpec, now: float) -> None:
        """New rate and depth. Added depth arrives full (a new replica is idle and can work
        at once); on a shrink the level is only capped, keeping what was already spent."""
        self.refill(now)
        grown = spec.depth - self.depth
        self.rate, self.depth = spec.rate, spec.depth
        if grown > 0 and grown != INF:
            self.level += grown
        self.level = min(self.level, spec.depth)

    def credit(self, tokens: float, now: float) -> None:
        """Give back tokens (negative: charge more), never above the depth."""
        self.refill(now)
        self.level = min(self.depth, self.level + tokens)


class _Entitlement:
    __slots__ = (
        "admitted",
        "base_concurrency",
        "base_kv",
        "burst",
        "conc_seconds",
        "concurrency",
        "debt",
        "demand",
        "hold_concurrency",
        "hold_kv",
        "kv",
        "kv_seconds",
        "leases",
        "name",
        "own",
        "pool",
        "priority",
        "protected",
        "settled",
        "t_acc",
        "window_start",
    )

    def __init__(self, name: str, pool: str, own: _Bucket, now: float) -> None:
        self.name, self.pool, self.own = name, pool, own
        self.protected = False
        self.base_concurrency = self.base_kv = 0.0
        self.hold_concurrency = self.hold_kv = 0.0  # current share of the pool's holdback
        self.concurrency = self.kv = 0.0
        self.leases = 0
        self.debt = self.burst = self.priority = 0.0
        self.t_acc = self.window_start = now
        self.conc_seconds = self.kv_seconds = self.settled = self.demand = 0.0
        self.admitted = 0.0

    def accumulate(self, now: float) -> None:
        dt = now - self.t_acc
        if dt > 0:
            self.conc_seconds += self.concurrency * dt
            self.kv_seconds += self.kv * dt
            self.t_acc = now


class _Pool:
    __slots__ = (
        "bucket",
        "concurrency",
        "hold_concurrency",
        "hold_kv",
        "inflight",
        "kv",
        "last_period",
        "leases",
        "low",
        "pre_concurrency",
        "pre_kv",
        "preemptible_by_ent",
        "protected",
        "protected_bucket",
        "refused",
        "refused_top",
    )

    def __init__(self, bucket: _Bucket, protected_bucket: _Bucket) -> None:
        self.bucket, self.protected_bucket = bucket, protected_bucket
        self.concurrency = self.kv = self.pre_concurrency = self.pre_kv = 0.0
        self.hold_concurrency = self.hold_kv = 0.0
        self.leases = 0
        # entitlement → its in-flight leases on the shared path: the competitors of check 5.
        # Work inside a reserved baseline is not competing for shared capacity, so it neither
        # sets nor faces the threshold.
        self.inflight: dict[str, int] = {}
        # (priority, entitlement) of entitlements in flight, a lazy heap; None: rebuild it.
        self.low: list[tuple[float, str]] | None = None
        self.preemptible_by_ent: dict[str, dict[str, Lease]] = {}
        self.protected: set[str] = set()  # entitlements holding a reserved baseline
        # entitlement → (when it was last refused room, its priority then); the top of them
        self.refused: dict[str, tuple[float, float]] = {}
        self.refused_top: tuple[float, str, float] | None = None
        self.last_period = -1


class MemoryStore:
    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}
        self._ents: dict[str, _Entitlement] = {}
        self._leases: dict[str, Lease] = {}
        self._expiry: list[tuple[float, str]] = []

    # -- configuration -------------------------------------------------------------------

    def configure_pool(
        self, pool: str, bucket: BucketSpec, protected_bucket: BucketSpec, now: float
    ) -> None:
        p = self._pools.get(pool)
        if p is None:
            self._pools[pool] = _Pool(_Bucket(bucket, now), _Bucket(protected_bucket, now))
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
            e = self._ents[name] = _Entitlement(name, pool, _Bucket(own_bucket, now), now)
        else:
            e.own.reshape(own_bucket, now)
        p = self._pools[pool]
        e.protected = protected
        if protected:
            p.protected.add(name)
        else:
            p.protected.discard(name)
        e.base_concurrency, e.base_kv = holdback_concurrency, holdback_kv
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

    def remove_entitlement(self, name: str) -> list[Lease]:
        e = self._ents.get(name)
        if e is None:
            return []
        ended = [lease for lease in self._leases.values() if lease.entitlement == name]
        for lease in ended:
            self._finish(lease, e.t_acc, bucket_used=lease.tokens, observed=0.0)
        p = self._pools[e.pool]
        e.base_concurrency = e.base_kv = 0.0
        self._update_holdback(e, p)
        p.protected.discard(name)
        p.refused.pop(name, None)
        p.refused_top = None
        del self._ents[name]
        return ended

    # -- the atomic step -----------------------------------------------------------------

    def reserve(
        self,
        lease: Lease,
        plan: ReservePlan,
        now: float,
        overcommit: bool = False,
        evict: Sequence[str] = (),
        demand: float = 0.0,
    ) -> Shortfall | None:
        e = self._ents[lease.entitlement]
        p = self._pools[lease.pool]
        e.demand += demand
        tokens, kv = lease.tokens, lease.kv_tokens
        # Victims are checked as if already gone, and ended only if the reservation succeeds.
        used_c, used_k, pre_c, pre_k = p.concurrency, p.kv, p.pre_concurrency, p.pre_kv
        victims = [
            v
            for v in map(self._leases.get, evict)
            if v is not None and v.preemptible and v.pool == lease.pool
        ]
        for victim in victims:
            used_c -= 1
            pre_c -= 1
            used_k -= victim.kv_tokens
            pre_k -= victim.kv_tokens
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
        bucket = p.bucket
        bucket.refill(now)
        pbucket = p.protected_bucket
        pbucket.refill(now)

        if own_ok and conc_after <= plan.base_concurrency and kv_after <= plan.base_kv:
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
            elif bucket.level - tokens < lf:
                short = Shortfall.POOL_THROUGHPUT
            if short is not None:
                self._refused(p, e, now)
                return short
            own.level -= tokens
            pbucket.level -= tokens
            lease.reserved_path = lease.drew_own = True
        else:
            hold_c, hold_k = p.hold_concurrency, p.hold_kv
            unreserved = bucket.level - pbucket.level - tokens
            if (
                used_c + hold_c + 1 > plan.contended_concurrency
                or used_k + hold_k + kv > plan.contended_kv
                or unreserved < plan.contended_bucket
            ) and self._outranked(p, e, now - plan.contention_window_s):
                self._refused(p, e, now)
                return Shortfall.LOW_PRIORITY
            # What is held for protected baselines first: evicting preemptible work cannot
            # help there (its plan limit is infinite for preemptible requests).
            short = None
            if used_c - pre_c + hold_c + 1 > plan.shared_np_concurrency:
                short = Shortfall.RESERVED_CONCURRENCY
            elif used_k - pre_k + hold_k + kv > plan.shared_np_kv:
                short = Shortfall.RESERVED_KV
            elif unreserved < plan.shared_np_bucket_floor:
                short = Shortfall.RESERVED_THROUGHPUT
            elif used_c + 1 > plan.shared_concurrency:
                short = Shortfall.POOL_CONCURRENCY
            elif used_k + kv > plan.shared_kv:
                short = Shortfall.POOL_KV
            elif bucket.level - tokens < plan.shared_bucket_floor:
                short = Shortfall.POOL_THROUGHPUT
            if short is not None:
                self._refused(p, e, now)
                return short
            if plan.own_required:
                own.level -= tokens
                lease.drew_own = True
        for victim in victims:
            self._finish(victim, now, bucket_used=victim.tokens, observed=0.0)
        bucket.level -= tokens
        e.admitted += tokens
        self._book(lease, e, p, now)
        return None

    @staticmethod
    def _refused(p: _Pool, e: _Entitlement, now: float) -> None:
        """Remember that `e` was refused room: unmet demand, for check 5. The cached top stays
        the highest entry of the dict, or None (rebuilt when next asked)."""
        p.refused[e.name] = (now, e.priority)
        top = p.refused_top
        if top is None:
            return
        if e.priority >= top[0]:
            p.refused_top = (e.priority, e.name, now)
        elif top[1] == e.name:  # the top entry itself went down
            p.refused_top = None

    def _outranked(self, p: _Pool, e: _Entitlement, since: float) -> bool:
        """Check 5 for a request in a pool near full: refused when another entitlement of
        higher priority was refused room since `since` (its demand is unmet), and this one's
        priority is below the paper's threshold — the lowest priority in flight among the
        others — so the lowest-priority work in flight is what gives way. Demand-awareness
        keeps the pool work-conserving: nobody is shed for a tenant that wants nothing.

        The highest refusal is cached; the dict is scanned (dropping aged entries) when that
        one has aged out, or for the others' highest when it is the asker's own."""
        w = e.priority
        top = p.refused_top
        if top is None or top[2] < since:
            top = None
            for name, (t, priority) in list(p.refused.items()):
                if t < since:
                    del p.refused[name]
                elif top is None or priority > top[0]:
                    top = (priority, name, t)
            p.refused_top = top
        if top is not None and top[1] == e.name:  # the asker's own: the highest of the others
            top = max(
                ((pr, n, t) for n, (t, pr) in p.refused.items() if n != e.name and t >= since),
                default=None,
            )
        if top is None or top[0] <= w:
            return False
        return w < self._threshold(p, e.name)

    def _threshold(self, p: _Pool, name: str) -> float:
        """The lowest priority among *other* entitlements' shared-path leases in flight: a
        tenant never blocks itself, or check 5 could never fire for a tenant already served.

        A heap of (priority, entitlement) with lazy deletion: entries of entitlements no
        longer in flight are dropped when they reach the top. A priority change drops the
        whole heap (set_scores), so every entry carries its entitlement's current priority."""
        heap = p.low
        if heap is None or len(heap) > 2 * len(p.inflight) + 32:
            heap = p.low = [(self._ents[n].priority, n) for n in p.inflight]
            heapq.heapify(heap)
        inflight = p.inflight
        while heap and heap[0][1] not in inflight:
            heapq.heappop(heap)
        if not heap:
            return -INF
        if heap[0][1] != name:
            return heap[0][0]
        mine = []
        while heap and (heap[0][1] == name or heap[0][1] not in inflight):
            entry = heapq.heappop(heap)
            if entry[1] == name:
                mine.append(entry)
        threshold = heap[0][0] if heap else -INF
        for entry in mine:
            heapq.heappush(heap, entry)
        return threshold

    # -- bookkeeping ---------------------------------------------------------------------

    def _book(self, lease: Lease, e: _Entitlement, p: _Pool, now: float) -> None:
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
            p.preemptible_by_ent.setdefault(lease.entitlement, {})[lease.lease_id] = lease
        if e.protected:
            self._update_holdback(e, p)
        if not lease.reserved_path:
            count = p.inflight.get(e.name, 0)
            p.inflight[e.name] = count + 1
            if count == 0 and p.low is not None:
                heapq.heappush(p.low, (e.priority, e.name))
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))

    def _finish(self, lease: Lease, now: float, bucket_used: float, observed: float) -> None:
        del self._leases[lease.lease_id]
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
            group = p.preemptible_by_ent[lease.entitlement]
            del group[lease.lease_id]
            if not group:
                del p.preemptible_by_ent[lease.entitlement]
        if e.protected:
            self._update_holdback(e, p)
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

    @staticmethod
    def _update_holdback(e: _Entitlement, p: _Pool) -> None:
        hold_c = max(0.0, e.base_concurrency - e.concurrency)
        hold_k = max(0.0, e.base_kv - e.kv)
        p.hold_concurrency += hold_c - e.hold_concurrency
        p.hold_kv += hold_k - e.hold_kv
        e.hold_concurrency, e.hold_kv = hold_c, hold_k

    # -- ending leases -------------------------------------------------------------------

    def settle(self, lease_id: str, used_tokens: float, now: float) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._finish(lease, now, bucket_used=used_tokens, observed=used_tokens)
        return lease

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._finish(lease, now, bucket_used=0.0 if refund else lease.tokens, observed=0.0)
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

    def renew(self, lease_id: str, expires_at: float) -> bool:
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
                self._finish(lease, now, bucket_used=lease.tokens, observed=0.0)
                ended.append(lease)
        if not self._leases:
            heap.clear()  # drop stale entries of settled leases
        return ended

    def get_lease(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    @property
    def leases(self) -> Mapping[str, Lease]:
        """Every lease in flight, by id. A read-only view: do not mutate."""
        return self._leases

    def preemptible_leases(self, pool: str) -> Mapping[str, Mapping[str, Lease]]:
        return self._pools[pool].preemptible_by_ent

    # -- observation and scores ----------------------------------------------------------

    def take_window(self, name: str, now: float) -> Window:
        e = self._ents[name]
        e.accumulate(now)
        window = Window(
            seconds=now - e.window_start,
            settled_tokens=e.settled,
            demand_tokens=e.demand,
            admitted_tokens=e.admitted,
            concurrency_seconds=e.conc_seconds,
            kv_seconds=e.kv_seconds,
        )
        e.window_start = now
        e.settled = e.demand = e.admitted = e.conc_seconds = e.kv_seconds = 0.0
        return window

    def scores(self, name: str) -> Scores:
        e = self._ents[name]
        return Scores(e.debt, e.burst, e.priority)

    def set_scores(self, name: str, scores: Scores) -> None:
        e = self._ents[name]
        if e.priority != scores.priority:
            self._pools[e.pool].low = None
        e.debt, e.burst, e.priority = scores.debt, scores.burst, scores.priority

    def claim_update(self, pool: str, period: int) -> bool:
        p = self._pools[pool]
        if period <= p.last_period:
            return False
        p.last_period = period
        return True

    def pool_counters(self, pool: str, now: float) -> PoolCounters:
        p = self._pools[pool]
        p.bucket.refill(now)
        p.protected_bucket.refill(now)
        return PoolCounters(
            concurrency=p.concurrency,
            kv_tokens=p.kv,
            preemptible_concurrency=p.pre_concurrency,
            preemptible_kv=p.pre_kv,
            holdback_concurrency=p.hold_concurrency,
            holdback_kv=p.hold_kv,
            bucket=p.bucket.level,
            protected_bucket=p.protected_bucket.level,
            leases=p.leases,
        )

    def entitlement_counters(self, name: str, now: float) -> EntitlementCounters:
        e = self._ents[name]
        e.own.refill(now)
        return EntitlementCounters(e.concurrency, e.kv, e.own.level, e.leases)
