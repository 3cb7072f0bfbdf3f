"""The Redis store's hot path for an asyncio host: admit, settle, release and renew, each one
awaited call of the same script (redis.asyncio), sharing the replica's bookkeeping with its
`RedisStore`. What is rare and may take several calls (booking our leases again after Redis
lost its data, sending lease ends kept during an outage) runs on a worker thread through the
synchronous store, so the event loop never waits on Redis."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import redis

from tokenpools.control.metering import NO_CHARGE, Charge
from tokenpools.control.store import Lease, Outcome, Reservation, StoreUnavailable
from tokenpools.state.redis import connect as redis_connect
from tokenpools.state.redis import wire
from tokenpools.state.redis.link import FAILURES, finish_args, finish_calls
from tokenpools.state.redis.mux import Multiplexed
from tokenpools.state.redis.store import RedisStore

# Calls of one kind (admit, finish) for one pool on their way at once. More than one keeps the
# connection busy while the next group gathers; the rest wait and go together.
CALLS_ON_THE_WAY = 2


class RedisHotPath:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.client = redis_connect.async_client(store.url, store.timeout_s)
        self._script = self.client.register_script(wire.SCRIPT)
        store.unsent_on_hot_path = True
        if isinstance(self.client, Multiplexed):
            # Replies that come after their calls timed out end an outage at once: a Redis
            # that was paused answers them as soon as it runs again.
            self.client.on_reply = store.answered
        self._flushing: asyncio.Task[None] | None = None
        self._calls = asyncio.Semaphore(redis_connect.CONNECTIONS)
        # by (operation, pool): what waits for the call on its way (when, arguments, caller)
        self._queued: dict[tuple[str, str], list[tuple[float, list[str], asyncio.Future[Any]]]]
        self._queued = {}
        self._sending: dict[tuple[str, str], set[asyncio.Task[None]]] = {}  # calls on the way

    async def warm(self) -> None:
        """Connect before the first requests, so that a burst of them does not pay for (or
        time out on) connecting; an unreachable Redis is left to the calls."""
        with contextlib.suppress(*FAILURES):
            if isinstance(self.client, Multiplexed):
                await self.client.connect()
            else:
                # A cluster client: learn the layout and load the script before a burst of
                # calls does, all at once (they would race to set it up, and drop each other's
                # connections, or each load the script under its own timeout).
                await self.client.initialize()
                await self.client.script_load(wire.SCRIPT)

    async def aclose(self) -> None:
        """Wait for every call on its way, send the lease ends owed (if Redis answers: what
        it does not hear expires with its lease), then disconnect."""
        while pending := [
            *(t for tasks in self._sending.values() for t in tasks),
            *([self._flushing] if self._flushing else []),
        ]:
            await asyncio.gather(*pending, return_exceptions=True)
        with contextlib.suppress(StoreUnavailable):
            await self.send_unsent()
        await self.client.aclose()

    async def _call(self, pool: str, op: str, now: float, args: Sequence[str]) -> Any:
        store = self.store
        store.check_available()
        try:
            if store.has_unsent:
                await self._unsent_sent()
            reply = await self._run(pool, op, now, args)
        except Exception as exc:
            raise store.went_down(exc) from exc
        store.answered()
        return reply

    async def send_unsent(self) -> None:
        """Send the lease ends owed now, if Redis is thought reachable (each tick does)."""
        store = self.store
        if store.has_unsent and store.available:
            try:
                await self._unsent_sent()
            except Exception as exc:
                raise store.went_down(exc) from exc
            store.answered()

    async def _unsent_sent(self) -> None:
        """The lease ends owed go before this call, on the same connection: a booking that a
        given-up admission made there is ended before this call is decided, so it never
        counts against the next request. Concurrent callers wait for one send."""
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._send_unsent())
        flushing = self._flushing
        try:
            await asyncio.shield(flushing)
        finally:
            if flushing.done() and self._flushing is flushing:
                self._flushing = None

    async def _send_unsent(self) -> None:
        owed = self.store.take_unsent()
        try:
            for pool, now, args in finish_calls(owed):
                await self._run(pool, "finish", now, args)
        except BaseException:
            self.store.unsent_again(owed)
            raise

    async def _eval(self, pool: str, op: str, epoch: str, now: float, args: Sequence[str]) -> Any:
        keys, argv = self.store.call_args(pool, op, epoch, now, args)
        async with self._calls:  # a burst waits here, not on hundreds of new connections
            return await self._script(keys=keys, args=argv)

    async def _run(self, pool: str, op: str, now: float, args: Sequence[str]) -> Any:
        epoch = self.store.epoch(pool)
        try:
            return await self._eval(pool, op, epoch, now, args)
        except redis.ResponseError as exc:
            if not self.store.needs_rejoin(exc):
                raise
        await asyncio.to_thread(self.store.rejoin, pool, now, epoch)
        return await self._eval(pool, op, self.store.epoch(pool), now, args)

    async def admit(self, reservation: Reservation, now: float) -> Outcome:
        """One admission, awaited. Whatever keeps its reply from this caller (a timeout, a
        lost connection, the caller cancelled, even after the reply came), the admission is
        given up, and Redis is owed its end (`RedisLink.given_up`)."""
        return (await self.admit_first((reservation,), now))[-1]

    async def admit_first(self, reservations: Sequence[Reservation], now: float) -> list[Outcome]:
        """A request's layers (`Store.admit_first`), awaited as `admit` is: one call."""
        first, store = reservations[0].lease, self.store
        args = wire.layers_args(reservations, now, store.budget_key)
        for retry in (False, True):
            with store.booking(first, now):
                decided = await self._together("admit", first.pool, now, args)
            tried = store.layers_admitted(reservations, decided)
            # A refusal decided while we owed Redis lease ends may have counted a booking we
            # had given up (an admission sent just before the one that gave up reached Redis
            # ahead of its end): decided once more, after those ends, which go first.
            if tried[-1].shortfall is None or retry or not self.owes:
                return tried
        raise AssertionError("unreachable")

    @property
    def owes(self) -> bool:
        """Whether lease ends are owed to Redis, or on their way there."""
        return self.store.has_unsent or self._flushing is not None

    async def adopt(self, lease: Lease, now: float) -> bool:
        """Book a lease the local budget admitted, as `RedisStore.adopt` does, on this path:
        ordered with the admissions and ends that follow it."""
        with self.store.booking(lease, now):
            reply = await self._call(lease.pool, "adopt", now, wire.lease_args(lease))
        return self.store.adopted(lease, reply)

    async def settle(
        self, lease: Lease, used_tokens: float, now: float, charge: Charge | None = None
    ) -> None:
        charge = Charge(tokens=used_tokens) if charge is None else charge
        await self._finish(lease, now, wire.num(used_tokens), used_tokens, charge)

    async def release(self, lease: Lease, now: float, refund: bool = True) -> None:
        await self._finish(lease, now, "0.0" if refund else "all", 0.0)

    async def recharge(self, lease: Lease, charge: Charge, now: float) -> None:
        """`RedisStore.recharge`, on this path (after the lease's own end, which went first)."""
        if lease.meter is not None:
            args = wire.recharge_args(lease, charge, self.store.budget_key)
            await self._call(lease.pool, "recharge", now, args)

    async def _finish(
        self, lease: Lease, now: float, used: str, observed: float, charge: Charge = NO_CHARGE
    ) -> None:
        store = self.store
        args = finish_args(lease.lease_id, used, observed, now, charge=charge)
        mine = store.forget(lease.lease_id)
        try:
            await self._together("finish", lease.pool, now, args)
        except StoreUnavailable:
            store.unsent(mine, lease.pool, now, args)  # raises again if it is not ours
        except BaseException:  # cancelled on the way: Redis may not have heard it
            if mine is not None:
                store.unsent(mine, lease.pool, now, args)
            raise

    async def _together(self, op: str, pool: str, now: float, args: list[str]) -> Any:
        """Group commit: the admissions (or lease ends) of one pool that come while a call of
        the same kind for that pool is on its way go together in the next call, one script
        call and one read and write of the pool for all of them, each decided in its turn.
        The first goes at once, so nothing waits when the gateway is idle. Returns this
        group's part of the reply."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queued.setdefault((op, pool), []).append((now, args, future))
        senders = self._sending.setdefault((op, pool), set())
        if len(senders) < CALLS_ON_THE_WAY:
            senders.add(loop.create_task(self._send((op, pool))))
        return await future

    async def _send(self, kind: tuple[str, str]) -> None:
        op, pool = kind
        try:
            while batch := self._queued.pop(kind, None):
                # Lease ends that came before these admissions are decided before them: a
                # client's next request never finds its last one still booked.
                if op == "admit" and (ends := self._queued.pop(("finish", pool), None)):
                    await self._send_batch("finish", pool, ends)
                await self._send_batch(op, pool, batch)
        finally:
            # In the same step as the loop's last look, so nothing queued goes unseen.
            senders = self._sending[kind]
            senders.discard(asyncio.current_task())
            if not senders:
                del self._sending[kind]
                for _, _, future in self._queued.pop(kind, []):  # only after a cancellation
                    future.cancel()

    async def _send_batch(
        self, op: str, pool: str, batch: list[tuple[float, list[str], asyncio.Future[Any]]]
    ) -> None:
        args = [a for _, group, _ in batch for a in group]
        try:
            replies = await self._call(pool, op, max(now for now, _, _ in batch), args)
        except StoreUnavailable as exc:
            for _, _, future in batch:
                if not future.done():  # its caller may have been cancelled
                    future.set_exception(StoreUnavailable(str(exc)))
            return
        except BaseException:
            for _, _, future in batch:
                future.cancel()
            raise
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if not future.done():  # a cancelled caller gave its admission up
                future.set_result(reply)

    async def renew(self, lease: Lease, expires_at: float, now: float) -> bool:
        args = wire.args("renew", id=lease.lease_id, expires=wire.num(expires_at))
        reply = await self._call(lease.pool, "renew", now, args)
        return self.store.renewed(lease.lease_id, expires_at, reply)
