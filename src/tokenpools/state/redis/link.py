"""One replica's link to the Redis ledger: calls of the script, and the outage policy's memory.

Every call has a timeout. A call that fails gets the outage policy for its own request; Redis
is judged unreachable only after `FAILURES_TO_DOWN` failures in a row or a lost connection, and
then the link answers `StoreUnavailable` at once, without trying, for `retry_interval_s`, after
which one call tries again: a dead Redis costs a request at most one timeout, and one late reply
does not refuse everyone else's traffic (docs/redis.md).

What cannot wait is kept: configuration (replayed when Redis comes back or has lost its data) and
the ends Redis owes us. Those are the ends of our leases that did not get through, and the
admissions whose reply their caller never took (a timeout, a cancelled caller, a lost
connection): Redis may have booked those, or may still, so each is ended with a tombstone that
refuses a late booking. They are sent before the next call that reaches Redis, which every tick
makes. When Redis lost its data (the pool's epoch changed) the leases this replica still holds
are booked again, once. `RedisStore` builds the ledger's operations on it; `RedisHotPath`
shares it for the awaited hot path.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from tokenpools.control.metering import NO_CHARGE, BudgetHold, Charge
from tokenpools.control.store import Lease, StoreUnavailable
from tokenpools.state.redis import connect as redis_connect
from tokenpools.state.redis import wire

# Any error from Redis (unreachable, timed out, out of memory, busy) makes the store unavailable
# for a while: the core then applies the outage policy rather than failing the request.
FAILURES = (redis.RedisError, OSError)
# Failed calls in a row (nothing answered between them) that make Redis unreachable: one late
# reply is a slow call, not an outage. A refused or lost connection is unreachable at once.
FAILURES_TO_DOWN = 2
Owed = tuple[str, float, list[str]]  # a lease end Redis has not confirmed: pool, when, arguments
log = logging.getLogger("tokenpools.state")


class RedisLink:
    """One replica's connection to the ledger script, and what it keeps across outages."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        timeout_s: float = 0.25,
        retry_interval_s: float = 0.25,
        prefix: str = "tokenpools",
        clock: Callable[[], float] = time.monotonic,
        client: Any = None,
        owner: str | None = None,
        replica_timeout_s: float = 10.0,
    ) -> None:
        """`owner`: this replica's name, unique per process start (the leases it books are
        its own); a replica that has not expired leases for `replica_timeout_s` is gone, and
        the others end its leases."""
        self.owner = owner or f"store-{secrets.token_hex(6)}"
        self.replica_timeout_s = replica_timeout_s
        self.url, self.timeout_s = url, timeout_s
        self.client = client or redis_connect.sync_client(url, timeout_s)
        self._script = self.client.register_script(wire.SCRIPT)
        self._prefix = prefix
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._down_until = -float("inf")
        self._failures = 0  # failed calls since Redis last answered
        self._epoch: dict[str, str] = {}  # pool → the epoch this replica's view belongs to
        self._pool_args: dict[str, list[str]] = {}  # the latest configuration, for replays
        self._ent_args: dict[str, list[str]] = {}
        self._ent_pool: dict[str, str] = {}
        self._mine: dict[str, Lease] = {}  # leases booked by this replica and not seen ended
        self._unsent: list[Owed] = []  # lease ends Redis has not confirmed, in order
        # Set by an awaited hot path: it alone sends them, ahead of its own calls on its one
        # connection, so none of its calls is decided before an end owed.
        self.unsent_on_hot_path = False
        # The hot path and the worker thread may both rejoin.
        self._rejoining = threading.Lock()

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def key(self, pool: str) -> str:
        return f"{self._prefix}:{{{pool}}}"

    def budget_key(self, hold: BudgetHold) -> str:
        """A budget window's counter: in its pool's hash slot when it has one (a Redis Cluster
        needs that: control/budgets.py), else beside every other budget."""
        return f"{self._prefix}:{{{hold.home or '~budgets'}}}:b:{hold.key}"

    def epoch(self, pool: str) -> str:
        return self._epoch.get(pool, "")

    @property
    def has_unsent(self) -> bool:
        return bool(self._unsent)

    def forget(self, lease_id: str) -> Lease | None:
        """Stop tracking one of our leases (it is ending); the lease, if it was ours."""
        return self._mine.pop(lease_id, None)

    # -- calls ---------------------------------------------------------------------------

    def check_available(self) -> None:
        if self._clock() < self._down_until:
            raise StoreUnavailable("redis is unreachable; retrying later")

    def went_down(self, exc: Exception) -> StoreUnavailable:
        """Any failure of a call: Redis unreachable, timed out or refusing, or the client
        itself broken (seen: redis-py's asyncio cluster client during a failover). Either way
        the outage policy applies to the call's request, never an error; to every request
        once Redis is judged unreachable."""
        if not isinstance(exc, FAILURES):
            log.error("redis client failed: %r", exc, exc_info=exc)
        self._failures += 1
        lost = isinstance(exc, (redis.ConnectionError, OSError)) and not isinstance(
            exc, redis.TimeoutError
        )
        if lost or self._failures >= FAILURES_TO_DOWN:
            if self._down_until == -float("inf"):
                log.warning("redis: %s; the outage policy applies until it answers", exc)
            self._down_until = self._clock() + self._retry_interval_s
        return StoreUnavailable(f"redis: {exc}")

    def answered(self) -> None:
        self._failures = 0
        if self._down_until != -float("inf"):
            self._down_until = -float("inf")
            log.warning("redis answers again")

    def _call(self, pool: str, op: str, now: float, args: Sequence[str]) -> Any:
        self.check_available()
        try:
            if self._unsent and not self.unsent_on_hot_path:
                self.send_unsent()
            reply = self._run(pool, op, now, args)
        except Exception as exc:
            raise self.went_down(exc) from exc
        self.answered()
        return reply

    def command(self, fn: Callable[[Any], Any]) -> Any:
        """A plain command, outside the script (a read, or a one-key write)."""
        self.check_available()
        try:
            reply = fn(self.client)
        except Exception as exc:
            raise self.went_down(exc) from exc
        self.answered()
        return reply

    def call_args(self, pool: str, op: str, epoch: str, now: float, args: Sequence[str]) -> Any:
        """KEYS and ARGV of one call of the script: ARGV is the header, then `args`."""
        return [self.key(pool)], [op, epoch, wire.num(now), self.owner, *args]

    def _eval(self, pool: str, op: str, epoch: str, now: float, args: Sequence[str]) -> Any:
        keys, argv = self.call_args(pool, op, epoch, now, args)
        return self._script(keys=keys, args=argv)

    def _run(self, pool: str, op: str, now: float, args: Sequence[str]) -> Any:
        epoch = self.epoch(pool)
        try:
            return self._eval(pool, op, epoch, now, args)
        except redis.ResponseError as exc:
            if not self.needs_rejoin(exc):
                raise
        self.rejoin(pool, now, epoch)
        return self._eval(pool, op, self.epoch(pool), now, args)

    @staticmethod
    def needs_rejoin(exc: redis.ResponseError) -> bool:
        """True for the script's "you know another epoch of this pool"."""
        return str(exc).startswith("TPEPOCH")

    def rejoin(self, pool: str, now: float, seen: str) -> None:
        """The pool in Redis is not the one we knew (first contact, or Redis lost its data):
        configure it again and book the leases this replica holds there, once each. `seen`:
        the epoch the refused call carried (if ours moved on since, another call rejoined)."""
        with self._rejoining:
            if self.epoch(pool) != seen:
                return
            args = self._pool_args.get(pool)
            if args is None:
                raise redis.ResponseError(f"pool {pool!r} was never configured")
            args = [*args[:-1], secrets.token_hex(8)]  # a new epoch, should this create it
            epoch = self._eval(pool, "configure_pool", "", now, args).decode()
            self._epoch[pool] = epoch
            for name, ent_args in list(self._ent_args.items()):
                if self._ent_pool[name] == pool:
                    self._eval(pool, "configure_entitlement", epoch, now, ent_args)
            for lease in list(self._mine.values()):
                if lease.pool == pool:
                    self._eval(pool, "adopt", epoch, now, wire.lease_args(lease))

    def take_unsent(self) -> list[Owed]:
        """The lease ends owed, to send now; hand them back with `unsent_again` if that
        fails. (The hot path and the worker thread may both send: a lease ends once, so an
        end that goes twice does no harm.)"""
        owed, self._unsent = self._unsent, []
        return owed

    def unsent_again(self, owed: list[Owed]) -> None:
        self._unsent[:0] = owed

    def send_unsent(self) -> None:
        owed = self.take_unsent()
        try:
            for pool, now, args in finish_calls(owed):
                self._run(pool, "finish", now, args)
        except BaseException:
            self.unsent_again(owed)
            raise

    def unsent(self, mine: Lease | None, pool: str, now: float, args: list[str]) -> Lease:
        """Keep the end of one of our leases for when Redis answers again."""
        if mine is None:
            raise StoreUnavailable("redis is unreachable and the lease is not ours")
        self._unsent.append((pool, now, args))
        return mine

    @contextlib.contextmanager
    def booking(self, lease: Lease, now: float) -> Iterator[None]:
        """Around a call that books `lease` (admit, adopt), sync or awaited: whatever keeps
        its reply from the caller (a timeout, a lost connection, the caller cancelled, even
        after the reply came) gives the booking up. Nothing is sent while Redis is judged
        unreachable, so nothing is given up then."""
        self.check_available()
        try:
            yield
        except BaseException:
            self.given_up(lease, now)
            raise

    def given_up(self, lease: Lease, now: float) -> None:
        """An admission whose reply its caller did not take: Redis may have booked it, or may
        yet (a command still on its way). Owe Redis its end, refunded (the request never ran
        on it), with a tombstone until the lease would have expired, so that a late booking
        is refused; whichever comes first, nothing stays booked."""
        self._mine.pop(lease.lease_id, None)
        args = finish_args(lease.lease_id, "0.0", 0.0, now, keep=lease.expires_at)
        self._unsent.append((lease.pool, now, args))

    @property
    def owed(self) -> int:
        """Lease ends (given-up admissions included) Redis has not confirmed yet."""
        return len(self._unsent)


def finish_calls(owed: list[Owed]) -> list[Owed]:
    """Lease ends as one finish call per pool (each keeps its own time in its group)."""
    calls: dict[str, tuple[float, list[str]]] = {}
    for pool, now, args in owed:
        at, group = calls.setdefault(pool, (now, []))
        group.extend(args)
        calls[pool] = (max(at, now), group)
    return [(pool, now, args) for pool, (now, args) in calls.items()]


def finish_args(
    lease_id: str,
    used: str,
    observed: float,
    now: float,
    keep: float = 0.0,
    charge: Charge = NO_CHARGE,
) -> list[str]:
    """One lease end's group of the finish operation (several may go in one call)."""
    return wire.args(
        "finish",
        id=lease_id,
        used=used,
        observed=wire.num(observed),
        at=wire.num(now),
        keep=wire.num(keep),
        c_in=wire.num(charge.input),
        c_out=wire.num(charge.output),
        c_cached=wire.num(charge.cached),
        c_cost=wire.num(charge.cost),
    )
