"""The shared store: one Redis holds the ledger of every gateway replica.

Each operation is one call of one Lua script (state/redis/lua/, run by EVALSHA and loaded again on
NOSCRIPT; state/redis/wire.py declares its arguments and replies), so a whole admission is
atomic across replicas and costs one round trip. A pool's keys share one hash tag, so a pool
lives on one Redis Cluster shard (state/redis/connect.py makes the clients).

`RedisStore` is the synchronous Store (simulations, tests, the gateway's background work on its
worker thread); `RedisHotPath(store)` (hot_path.py) gives the gateway the same ledger awaited,
for admit, settle, release and renew, so its event loop never waits on Redis. Both share this
replica's bookkeeping (state/redis/link.py: calls, timeouts, what is kept while Redis is away).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from tokenpools.control.metering import NO_CHARGE, BudgetHold, Charge, PendingUsage, UsageRow
from tokenpools.control.store import (
    BucketSpec,
    EntitlementCounters,
    Lease,
    Outcome,
    PoolCounters,
    Reservation,
    Scores,
    Shortfall,
    StoreUnavailable,
    Window,
)
from tokenpools.state.redis import wire
from tokenpools.state.redis.link import RedisLink, finish_args


class RedisStore(RedisLink):
    def _pool_of_lease(self, lease_id: str, now: float) -> str | None:
        lease = self._mine.get(lease_id)
        if lease is not None:
            return lease.pool
        for pool in list(self._pool_args):
            if self._call(pool, "get_lease", now, wire.args("get_lease", id=lease_id)) is not None:
                return pool
        return None

    # -- configuration -------------------------------------------------------------------

    def configure_pool(
        self, pool: str, bucket: BucketSpec, protected_bucket: BucketSpec, now: float
    ) -> None:
        args = wire.args(
            "configure_pool",
            b_rate=wire.num(bucket.rate),
            b_depth=wire.num(bucket.depth),
            pb_rate=wire.num(protected_bucket.rate),
            pb_depth=wire.num(protected_bucket.depth),
            new_epoch=secrets.token_hex(8),  # the epoch, should this call create the pool
        )
        self._pool_args[pool] = args
        try:
            epoch = self._call(pool, "configure_pool", now, args)
        except StoreUnavailable:
            return  # replayed when Redis answers again
        # A pool another replica created, or ours: either way, our leases are its leases
        # only if we saw this epoch before.
        if self._epoch.get(pool) not in (None, epoch.decode()):
            self._epoch.pop(pool)
        else:
            self._epoch[pool] = epoch.decode()

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
        args = wire.args(
            "configure_entitlement",
            name=name,
            o_rate=wire.num(own_bucket.rate),
            o_depth=wire.num(own_bucket.depth),
            hold_c=wire.num(holdback_concurrency),
            hold_k=wire.num(holdback_kv),
            protected="1" if protected else "0",
        )
        self._ent_args[name] = args
        self._ent_pool[name] = pool
        with contextlib.suppress(StoreUnavailable):  # replayed when Redis answers again
            self._call(pool, "configure_entitlement", now, args)

    def remove_entitlement(self, name: str, now: float) -> list[Lease]:
        pool = self._ent_pool.pop(name, None)
        self._ent_args.pop(name, None)
        if pool is None:
            return []
        rows = self._call(
            pool, "remove_entitlement", now, wire.args("remove_entitlement", name=name)
        )
        ended = [wire.lease(row, pool) for row in rows]
        for lease in ended:
            self._mine.pop(lease.lease_id, None)
        return ended

    # -- the atomic step -----------------------------------------------------------------

    def admit(self, reservation: Reservation, now: float) -> Outcome:
        return self.admit_first((reservation,), now)[-1]

    def admit_first(self, reservations: Sequence[Reservation], now: float) -> list[Outcome]:
        first = reservations[0].lease
        with self.booking(first, now):
            args = wire.layers_args(reservations, now, self.budget_key)
            (decided,) = self._call(first.pool, "admit", now, args)
        return self.layers_admitted(reservations, decided)

    def layers_admitted(self, reservations: Sequence[Reservation], decided: Any) -> list[Outcome]:
        """Read the reply to a request's layers: an outcome per layer tried (one layer, or an
        error for the whole call: the reply itself)."""
        if len(reservations) == 1 or isinstance(decided, redis.ResponseError):
            return [self.admitted(reservations[0], decided)]
        return [self.admitted(r, reply) for r, reply in zip(reservations, decided, strict=False)]

    def admitted(self, reservation: Reservation, decided: Any) -> Outcome:
        """Read one admission's reply and book what it did in this replica's view."""
        if isinstance(decided, redis.ResponseError):  # this admission's own error
            message = str(decided)
            for code in ("TPDUPLICATE ", "TPGONE "):  # the caller's error, not Redis's
                if message.startswith(code):
                    raise ValueError(message.removeprefix(code))
            raise self.went_down(decided)
        lease = reservation.lease
        status, flags, ent, pool, rows, left, refused = decided
        counters = wire.entitlement_counters(ent), wire.pool_counters(pool)
        budget_left = tuple(map(float, left))
        if status != b"ok":
            short = Shortfall(status.decode())
            return Outcome(short, *counters, budget_left=budget_left, budget_refused=refused - 1)
        reserved, own, overcommit = (f == b"1" for f in flags)
        lease.reserved_path, lease.drew_own = reserved, own
        evicted = tuple(wire.lease(row, lease.pool) for row in rows)
        self._mine[lease.lease_id] = lease
        for victim in evicted:
            self._mine.pop(victim.lease_id, None)
        return Outcome(
            None, *counters, evicted=evicted, overcommit=overcommit, budget_left=budget_left
        )

    # -- ending leases -------------------------------------------------------------------

    def _finish(
        self, lease_id: str, now: float, used: str, observed: float, charge: Charge = NO_CHARGE
    ) -> Lease | None:
        pool = self._pool_of_lease(lease_id, now)
        if pool is None:
            return None
        args = finish_args(lease_id, used, observed, now, charge=charge)
        mine = self.forget(lease_id)
        try:
            (row,) = self._call(pool, "finish", now, args)
        except StoreUnavailable:
            return self.unsent(mine, pool, now, args)
        return None if row is None else wire.lease(row, pool)

    def settle(
        self, lease_id: str, used_tokens: float, now: float, charge: Charge | None = None
    ) -> Lease | None:
        charge = Charge(tokens=used_tokens) if charge is None else charge
        return self._finish(lease_id, now, wire.num(used_tokens), used_tokens, charge)

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        return self._finish(lease_id, now, "0.0" if refund else "all", 0.0)

    def take_back(self, lease_id: str, now: float) -> Lease | None:
        return self._finish(lease_id, now, "taken", 0.0)

    def recharge(self, lease: Lease, charge: Charge, now: float) -> None:
        if lease.meter is not None:
            args = wire.recharge_args(lease, charge, self.budget_key)
            self._call(lease.pool, "recharge", now, args)

    def renew(self, lease_id: str, expires_at: float, now: float) -> bool:
        pool = self._pool_of_lease(lease_id, now)
        if pool is None:
            return False
        args = wire.args("renew", id=lease_id, expires=wire.num(expires_at))
        return self.renewed(lease_id, expires_at, self._call(pool, "renew", now, args))

    def renewed(self, lease_id: str, expires_at: float, reply: Any) -> bool:
        if reply == 1:
            mine = self._mine.get(lease_id)
            if mine is not None:
                mine.expires_at = expires_at
            return True
        self._mine.pop(lease_id, None)  # ended by another replica (eviction) or expired
        return False

    def adopt(self, lease: Lease, now: float) -> bool:
        # A booking like an admission: one whose reply is lost may have been made, so it is
        # given up (ended, or refused should it come late) before the next try books it.
        with self.booking(lease, now):
            reply = self._call(lease.pool, "adopt", now, wire.lease_args(lease))
        return self.adopted(lease, reply)

    def adopted(self, lease: Lease, reply: Any) -> bool:
        self._mine[lease.lease_id] = lease  # held there under our id either way: ours to end
        return bool(reply == 1)

    def expire(self, now: float) -> list[Lease]:
        ended = []
        for pool in list(self._pool_args):
            stale = wire.num(now - self.replica_timeout_s)
            for row in self._call(pool, "expire", now, wire.args("expire", stale=stale)):
                lease = wire.lease(row, pool)
                self._mine.pop(lease.lease_id, None)
                ended.append(lease)
        return ended

    def get_lease(self, lease_id: str, now: float) -> Lease | None:
        mine = self._mine.get(lease_id)
        if mine is not None:
            return mine
        for pool in list(self._pool_args):
            row = self._call(pool, "get_lease", now, wire.args("get_lease", id=lease_id))
            if row is not None:
                return wire.lease(row, pool)
        return None

    def preemptible_leases(self, pool: str, now: float) -> Mapping[str, Mapping[str, Lease]]:
        groups: dict[str, dict[str, Lease]] = {}
        for row in self._call(pool, "preemptible", now, ()):
            lease = wire.lease(row, pool)
            groups.setdefault(lease.entitlement, {})[lease.lease_id] = lease
        return groups

    def resumable_leases(self, pool: str, now: float) -> Mapping[str, Mapping[str, Lease]]:
        groups: dict[str, dict[str, Lease]] = {}
        rows = sorted(
            (wire.lease(row, pool) for row in self._call(pool, "resumable", now, ())),
            key=lambda lease: (lease.started_at, lease.lease_id),
        )
        for lease in rows:
            groups.setdefault(lease.entitlement, {})[lease.lease_id] = lease
        return groups

    # -- observation and scores ----------------------------------------------------------

    def take_window(self, name: str, now: float) -> Window:
        args = wire.args("take_window", name=name)
        reply = self._call(self._ent_pool[name], "take_window", now, args)
        return Window(*map(float, reply))

    def scores(self, name: str, now: float) -> Scores:
        reply = self._call(self._ent_pool[name], "scores", now, wire.args("scores", name=name))
        if reply[0] is None:
            return Scores()
        return Scores(*(0.0 if v is None else float(v) for v in reply))

    def set_scores(self, name: str, scores: Scores, now: float) -> None:
        args = wire.args(
            "set_scores",
            name=name,
            debt=wire.num(scores.debt),
            burst=wire.num(scores.burst),
            priority=wire.num(scores.priority),
            peak_c=wire.num(scores.peak_concurrency),
            peak_k=wire.num(scores.peak_kv),
        )
        self._call(self._ent_pool[name], "set_scores", now, args)

    # -- budgets and the usage ledger ----------------------------------------------------

    def pending_usage(self, pool: str, now: float, limit: int) -> PendingUsage:
        source = f"redis:{self._prefix}:{pool}:{self.epoch(pool)}"
        args = wire.args("pending_usage", limit=str(limit))
        return wire.pending_usage(source, self._call(pool, "pending_usage", now, args))

    def ack_usage(self, pool: str, rows: Sequence[UsageRow], now: float) -> None:
        if rows:
            pairs = [a for r in rows for a in (f"{r.hour}:{r.bucket}", str(r.version))]
            self._call(pool, "ack_usage", now, pairs)

    def budget_usage(
        self, holds: Sequence[BudgetHold], now: float
    ) -> list[tuple[float, float, bool]]:
        """Read outside the script: a budget's counter may live outside every pool's slot."""
        keys = [self.budget_key(hold) for hold in holds]

        def read(client: Any) -> list[tuple[float, float, bool]]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(key, "used", "held", "refused")
            return [(float(u or 0), float(h or 0), r is not None) for u, h, r in pipe.execute()]

        return self.command(read) if keys else []

    def claim_notice(self, hold: BudgetHold, threshold: float, now: float) -> bool:
        key, field = self.budget_key(hold), f"n:{threshold:g}"
        return bool(self.command(lambda c: c.hsetnx(key, field, wire.num(now))))

    def claim_update(self, pool: str, period: int, now: float) -> bool:
        args = wire.args("claim_update", period=str(period))
        return bool(self._call(pool, "claim_update", now, args) == 1)

    def pool_counters(self, pool: str, now: float) -> PoolCounters:
        return wire.pool_counters(self._call(pool, "pool_counters", now, ()))

    def entitlement_counters(self, name: str, now: float) -> EntitlementCounters:
        args = wire.args("entitlement_counters", name=name)
        return wire.entitlement_counters(
            self._call(self._ent_pool[name], "entitlement_counters", now, args)
        )
