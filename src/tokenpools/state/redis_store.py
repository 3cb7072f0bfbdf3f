"""The shared store: one Redis holds the ledger of every gateway replica.

Each operation is one call of one Lua script (state/lua/, run by EVALSHA and loaded again on
NOSCRIPT; state/redis_wire.py writes its arguments and reads its replies), so the
check-and-reserve step is atomic across replicas and costs one round trip. A pool's keys share
one hash tag, so a pool lives on one Redis Cluster shard.

Redis may be unreachable. Every call has a timeout; after a failure the store answers
`StoreUnavailable` at once, without trying, for `retry_interval_s`, so a stalled Redis costs a
request at most one timeout. What cannot wait is kept: configuration (replayed when Redis comes
back or has lost its data) and the ends of leases (sent on recovery). When Redis lost its data —
the pool's epoch changed — the leases this replica still holds are booked again, once.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenpools.state import redis_wire as wire
from tokenpools.state.base import (
    BucketSpec,
    EntitlementCounters,
    Lease,
    PoolCounters,
    ReservePlan,
    Scores,
    Shortfall,
    StoreUnavailable,
    Window,
)

# Any error from Redis (unreachable, timed out, out of memory, busy) makes the store unavailable
# for a while: the core then applies the outage policy rather than failing the request.
_FAILURES = (redis.RedisError, OSError)
log = logging.getLogger("tokenpools.state")


class RedisStore:
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        timeout_s: float = 0.05,
        retry_interval_s: float = 1.0,
        prefix: str = "tokenpools",
        clock: Callable[[], float] = time.monotonic,
        client: redis.Redis | None = None,
    ) -> None:
        self.client = client or redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # no hidden retries: a request waits one timeout
        )
        self._script = self.client.register_script(wire.SCRIPT)
        self._prefix = prefix
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._down_until = -float("inf")
        self._epoch: dict[str, str] = {}  # pool → the epoch this replica's view belongs to
        self._pool_args: dict[str, list[str]] = {}  # the latest configuration, for replays
        self._ent_args: dict[str, list[str]] = {}
        self._ent_pool: dict[str, str] = {}
        self._mine: dict[str, Lease] = {}  # leases booked by this replica and not seen ended
        self._unsent: list[tuple[str, list[str]]] = []  # ends of leases Redis has not heard of
        self._now = 0.0
        # The counters a refused reserve answered with, valid until the next call: the core
        # reads them right after a refusal, and this saves that round trip.
        self._refusal: tuple[str, str, float, PoolCounters, EntitlementCounters] | None = None

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def key(self, pool: str) -> str:
        return f"{self._prefix}:{{{pool}}}"

    # -- calls ---------------------------------------------------------------------------

    def _call(self, pool: str, op: str, now: float, *args: str) -> Any:
        if self._clock() < self._down_until:
            raise StoreUnavailable("redis is unreachable; retrying later")
        self._now = now
        self._refusal = None
        try:
            if self._unsent:
                self._send_unsent()
            reply = self._run(pool, op, now, args)
        except _FAILURES as exc:
            if self._down_until == -float("inf"):
                log.warning("redis: %s; the outage policy applies until it answers", exc)
            self._down_until = self._clock() + self._retry_interval_s
            raise StoreUnavailable(f"redis: {exc}") from exc
        if self._down_until != -float("inf"):
            self._down_until = -float("inf")
            log.warning("redis answers again")
        return reply

    def _eval(self, pool: str, op: str, epoch: str, now: float, *args: str) -> Any:
        """One call of the script: ARGV is op, epoch, now, then the operation's own."""
        return self._script(keys=[self.key(pool)], args=[op, epoch, wire.num(now), *args])

    def _run(self, pool: str, op: str, now: float, args: Sequence[str]) -> Any:
        try:
            return self._eval(pool, op, self._epoch.get(pool, ""), now, *args)
        except redis.ResponseError as exc:
            if not str(exc).startswith("TPEPOCH"):
                raise
        self._rejoin(pool, now)
        return self._eval(pool, op, self._epoch.get(pool, ""), now, *args)

    def _rejoin(self, pool: str, now: float) -> None:
        """The pool in Redis is not the one we knew (first contact, or Redis lost its data):
        configure it again and book the leases this replica holds there, once each."""
        args = self._pool_args.get(pool)
        if args is None:
            raise redis.ResponseError(f"pool {pool!r} was never configured")
        epoch = self._eval(pool, "configure_pool", "", now, *args, secrets.token_hex(8)).decode()
        self._epoch[pool] = epoch
        for name, ent_args in self._ent_args.items():
            if self._ent_pool[name] == pool:
                self._eval(pool, "configure_entitlement", epoch, now, name, *ent_args)
        for lease in list(self._mine.values()):
            if lease.pool == pool:
                self._eval(pool, "adopt", epoch, now, *wire.lease_args(lease))

    def _send_unsent(self) -> None:
        while self._unsent:
            pool, args = self._unsent[0]
            self._run(pool, "finish", float(args[0]), args[1:])
            self._unsent.pop(0)

    def _pool_of_lease(self, lease_id: str) -> str | None:
        lease = self._mine.get(lease_id)
        if lease is not None:
            return lease.pool
        for pool in self._pool_args:
            if self._call(pool, "get_lease", self._now, lease_id) is not None:
                return pool
        return None

    # -- configuration -------------------------------------------------------------------

    def configure_pool(
        self, pool: str, bucket: BucketSpec, protected_bucket: BucketSpec, now: float
    ) -> None:
        args = [
            wire.num(bucket.rate),
            wire.num(bucket.depth),
            wire.num(protected_bucket.rate),
            wire.num(protected_bucket.depth),
        ]
        self._pool_args[pool] = args
        try:  # the last argument: the epoch, should this call create the pool
            epoch = self._call(pool, "configure_pool", now, *args, secrets.token_hex(8))
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
        args = [
            wire.num(own_bucket.rate),
            wire.num(own_bucket.depth),
            wire.num(holdback_concurrency),
            wire.num(holdback_kv),
            "1" if protected else "0",
        ]
        self._ent_args[name] = args
        self._ent_pool[name] = pool
        with contextlib.suppress(StoreUnavailable):  # replayed when Redis answers again
            self._call(pool, "configure_entitlement", now, name, *args)

    def remove_entitlement(self, name: str) -> list[Lease]:
        pool = self._ent_pool.pop(name, None)
        self._ent_args.pop(name, None)
        if pool is None:
            return []
        rows = self._call(pool, "remove_entitlement", self._now, name)
        ended = [wire.lease(row, pool) for row in rows]
        for lease in ended:
            self._mine.pop(lease.lease_id, None)
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
        reply = self._call(
            lease.pool,
            "reserve",
            now,
            *wire.lease_args(lease),
            "1" if overcommit else "0",
            wire.num(demand),
            *wire.plan_args(plan),
            *evict,
        )
        if reply[0] != b"ok":
            self._refusal = (
                lease.pool,
                lease.entitlement,
                now,
                wire.pool_counters(reply[1]),
                wire.entitlement_counters(reply[2]),
            )
            return Shortfall(reply[0].decode())
        lease.reserved_path = reply[1] == b"1"
        lease.drew_own = reply[2] == b"1"
        self._mine[lease.lease_id] = lease
        for victim in evict:
            self._mine.pop(victim, None)
        return None

    # -- ending leases -------------------------------------------------------------------

    def _finish(self, lease_id: str, now: float, used: str, observed: float) -> Lease | None:
        pool = self._pool_of_lease(lease_id)
        if pool is None:
            return None
        mine = self._mine.pop(lease_id, None)
        try:
            row = self._call(pool, "finish", now, lease_id, used, wire.num(observed))
        except StoreUnavailable:
            if mine is None:
                raise
            self._unsent.append((pool, [wire.num(now), lease_id, used, wire.num(observed)]))
            return mine
        return None if row is None else wire.lease(row, pool)

    def settle(self, lease_id: str, used_tokens: float, now: float) -> Lease | None:
        return self._finish(lease_id, now, wire.num(used_tokens), used_tokens)

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        return self._finish(lease_id, now, "0.0" if refund else "all", 0.0)

    def renew(self, lease_id: str, expires_at: float) -> bool:
        pool = self._pool_of_lease(lease_id)
        if pool is None:
            return False
        if self._call(pool, "renew", self._now, lease_id, wire.num(expires_at)) == 1:
            mine = self._mine.get(lease_id)
            if mine is not None:
                mine.expires_at = expires_at
            return True
        self._mine.pop(lease_id, None)  # ended by another replica (eviction) or expired
        return False

    def adopt(self, lease: Lease, now: float) -> bool:
        if self._call(lease.pool, "adopt", now, *wire.lease_args(lease)) != 1:
            return False
        self._mine[lease.lease_id] = lease
        return True

    def expire(self, now: float) -> list[Lease]:
        ended = []
        for pool in self._pool_args:
            for row in self._call(pool, "expire", now):
                lease = wire.lease(row, pool)
                self._mine.pop(lease.lease_id, None)
                ended.append(lease)
        return ended

    def get_lease(self, lease_id: str) -> Lease | None:
        mine = self._mine.get(lease_id)
        if mine is not None:
            return mine
        for pool in self._pool_args:
            row = self._call(pool, "get_lease", self._now, lease_id)
            if row is not None:
                return wire.lease(row, pool)
        return None

    def preemptible_leases(self, pool: str) -> Mapping[str, Mapping[str, Lease]]:
        groups: dict[str, dict[str, Lease]] = {}
        for row in self._call(pool, "preemptible", self._now):
            lease = wire.lease(row, pool)
            groups.setdefault(lease.entitlement, {})[lease.lease_id] = lease
        return groups

    # -- observation and scores ----------------------------------------------------------

    def take_window(self, name: str, now: float) -> Window:
        reply = self._call(self._ent_pool[name], "take_window", now, name)
        seconds, settled, demand, admitted, conc, kv = map(float, reply)
        return Window(seconds, settled, demand, admitted, conc, kv)

    def scores(self, name: str) -> Scores:
        reply = self._call(self._ent_pool[name], "scores", self._now, name)
        if reply[0] is None:
            return Scores()
        debt, burst, priority = map(float, reply)
        return Scores(debt, burst, priority)

    def set_scores(self, name: str, scores: Scores) -> None:
        self._call(
            self._ent_pool[name],
            "set_scores",
            self._now,
            name,
            wire.num(scores.debt),
            wire.num(scores.burst),
            wire.num(scores.priority),
        )

    def claim_update(self, pool: str, period: int) -> bool:
        return bool(self._call(pool, "claim_update", self._now, str(period)) == 1)

    def pool_counters(self, pool: str, now: float) -> PoolCounters:
        refusal = self._refusal
        if refusal is not None and refusal[0] == pool and refusal[2] == now:
            return refusal[3]
        return wire.pool_counters(self._call(pool, "pool_counters", now))

    def entitlement_counters(self, name: str, now: float) -> EntitlementCounters:
        refusal = self._refusal
        if refusal is not None and refusal[1] == name and refusal[2] == now:
            return refusal[4]
        return wire.entitlement_counters(
            self._call(self._ent_pool[name], "entitlement_counters", now, name)
        )
