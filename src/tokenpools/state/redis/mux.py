"""One connection to one Redis server, shared by every coroutine of a gateway replica.

Each call writes its command at once (the calls of one event-loop turn in one write) and waits
for its reply; Redis answers in order, so replies are matched to callers first in, first out.
This is pipelining without a pipeline object: a burst of admissions costs Redis one read and
one write, and the replica a few microseconds of Python per call. redis-py's asyncio client,
one connection per call in flight, measured ~230 µs of client CPU per script call here against
~15 µs for this (BENCHMARKS.md); at hundreds of requests per second that was most of what
Redis cost the gateway.

A call waits at most `timeout_s` of the event loop's own time: a timer that fires late because
the loop was blocked (a slow callback, a long garbage collection, a starved CPU) measured the
loop, not Redis, and waits once more instead (up to `STALL_REARMS` times). A call that timed out
keeps its place in the queue, and its late reply is dropped when it comes, so the connection
stays usable; a lost connection fails
every call in flight, and the next call connects again (to the address `locate` gives then,
which is how Sentinel's failovers are followed; a server that answers READONLY has been demoted,
and is left the same way)."""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import hiredis
import redis

Address = tuple[str, int]
# How often one call's deadline is put off because its timer fired late by more than half the
# timeout (the loop was blocked); bounded, so a loop that is always late still sees a dead Redis.
STALL_REARMS = 4


class _Call:
    """A call waiting for its reply, and the timer that fails it."""

    __slots__ = ("future", "rearms", "timer")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future
        self.timer: asyncio.TimerHandle | None = None
        self.rearms = 0

    def arm(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.timer = loop.call_at(loop.time() + timeout_s, self._expire, loop, timeout_s)

    def _expire(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        assert self.timer is not None
        late = loop.time() - self.timer.when()
        if late > timeout_s / 2 and self.rearms < STALL_REARMS:
            self.rearms += 1  # the loop was blocked past the deadline: measure Redis again
            self.arm(loop, timeout_s)
        elif not self.future.done():
            self.future.set_exception(
                redis.TimeoutError(f"redis did not answer within {timeout_s} s")
            )

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class _Protocol(asyncio.Protocol):
    def __init__(self, heard: Callable[[], None]) -> None:
        self.heard = heard
        self.reader = hiredis.Reader(replyError=redis.ResponseError)
        self.waiting: deque[_Call] = deque()
        self.pending: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.heard()  # a reply, even a late one, says the server answers
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            call = self.waiting.popleft()
            call.cancel()
            future = call.future
            if future.done():  # timed out: the caller has gone
                continue
            if isinstance(reply, redis.ResponseError):
                future.set_exception(reply)
                if str(reply).startswith("READONLY") and self.transport is not None:
                    self.transport.close()  # a master demoted by a failover: find the new one
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = redis.ConnectionError(f"connection to redis lost: {exc or 'closed'}")
        while self.waiting:
            call = self.waiting.popleft()
            call.cancel()
            if not call.future.done():
                call.future.set_exception(self.lost)

    def send(self, command: bytes, timeout_s: float) -> asyncio.Future[Any]:
        if self.lost is not None or self.transport is None:
            raise self.lost or redis.ConnectionError("not connected")
        loop = asyncio.get_running_loop()
        call = _Call(loop.create_future())
        call.arm(loop, timeout_s)
        if not self.pending:
            loop.call_soon(self._flush)
        self.pending.append(command)
        self.waiting.append(call)
        return call.future

    def _flush(self) -> None:
        if self.transport is not None and self.lost is None:
            self.transport.write(b"".join(self.pending))
        self.pending.clear()


def pack(args: Sequence[str | bytes | int]) -> bytes:
    return hiredis.pack_command(tuple(args))  # type: ignore[arg-type,no-any-return]


class Multiplexed:
    """The client: `call` any command; `register_script` gives what redis-py's does."""

    def __init__(
        self,
        locate: Callable[[], Awaitable[Address]],
        timeout_s: float,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
    ) -> None:
        self._locate = locate
        self.timeout_s = timeout_s
        self._hello: list[list[str | int]] = []
        if password is not None:
            user = [] if username is None else [username]
            self._hello.append(["AUTH", *user, password])
        if db:
            self._hello.append(["SELECT", db])
        self._protocol: _Protocol | None = None
        # called on every reply that arrives, late ones included (the store's "it answers")
        self.on_reply: Callable[[], None] = lambda: None
        self._connecting: asyncio.Task[_Protocol] | None = None

    async def connect(self) -> None:
        await self._connected()

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.lost is None:
            return protocol
        if self._connecting is None:  # the calls that find no connection share one attempt
            self._connecting = asyncio.get_running_loop().create_task(self._open())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _open(self) -> _Protocol:
        async with asyncio.timeout(self.timeout_s):
            host, port = await self._locate()
            _, protocol = await asyncio.get_running_loop().create_connection(
                lambda: _Protocol(self.on_reply), host, port
            )
        try:
            for command in self._hello:
                await protocol.send(pack(command), self.timeout_s)
        except BaseException:
            assert protocol.transport is not None
            protocol.transport.close()
            raise
        self._protocol = protocol
        return protocol

    async def call(self, *args: str | bytes | int) -> Any:
        return await self.call_packed(pack(args))

    async def call_packed(self, command: bytes) -> Any:
        protocol = await self._connected()
        return await protocol.send(command, self.timeout_s)

    def register_script(self, script: str) -> MultiplexedScript:
        return MultiplexedScript(self, script)

    def drop(self) -> None:
        """Close the connection (a reply it would bring is no longer wanted, or it leads to a
        server that is no longer the master); the next call connects again."""
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None

    async def aclose(self) -> None:
        self.drop()


class MultiplexedScript:
    """EVALSHA, falling back to EVAL (which loads the script) when Redis does not know it:
    after a restart, a SCRIPT FLUSH or a failover to a server that never ran it."""

    def __init__(self, client: Multiplexed, script: str) -> None:
        self.client = client
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()

    async def __call__(self, keys: Sequence[str], args: Sequence[str]) -> Any:
        try:
            return await self.client.call_packed(
                pack(["EVALSHA", self.sha, len(keys), *keys, *args])
            )
        except redis.ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.client.call("EVAL", self.script, len(keys), *keys, *args)
