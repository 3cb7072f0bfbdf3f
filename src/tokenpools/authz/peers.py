"""Several replicas of the ext_authz service behind one Service. A request is settled by the
replica that admitted it (it holds the ticket), but Envoy's access-log stream reaches whichever
replica it connected to. So each replica's tickets name the address its access-log service is
reached at (`<host:port>/<secret>`), and a line for a ticket another replica owns is sent on to
that replica — only if the address is one of the peers (what the peers' headless Service name
resolves to): a log line cannot make a replica connect anywhere else."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

log = logging.getLogger("tokenpools.authz")
OWNER_END = "/"  # a ticket is `<owner>/<secret>` where replicas forward; `<secret>` alone else
SEND_TIMEOUT_S = 10.0
Resolve = Callable[[], Awaitable[set[str]]]


def owner_of(ticket: str) -> str | None:
    """The access-log address of the replica that issued a ticket (None: a lone replica's)."""
    owner, end, _ = ticket.rpartition(OWNER_END)
    return owner if end else None


def resolver(name: str, port: int) -> Resolve:
    """The peers as a headless Service names them: every address `name` resolves to, at the
    access-log port they all share."""

    async def resolve() -> set[str]:
        found = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
        return {f"{info[4][0]}:{port}" for info in found}

    return resolve


class Peers:
    def __init__(self, own: str, resolve: Resolve) -> None:
        """`own`: this replica's access-log address, as the others reach it."""
        self.own, self.resolve = own, resolve
        self.known: frozenset[str] = frozenset()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._sending: set[asyncio.Task[None]] = set()

    async def refresh(self) -> None:
        try:
            self.known = frozenset(await self.resolve())
        except OSError as exc:  # keep the last answer; the next refresh asks again
            log.warning("resolving the ext_authz peers failed: %s", exc)

    def accepts(self, owner: str) -> bool:
        """A line for this owner's ticket may be sent on to it."""
        return owner != self.own and owner in self.known

    def send(self, owner: str, entries: list[al.HTTPAccessLogEntry]) -> None:
        """Send lines on to the replica that owns their tickets, off the stream that brought
        them (a peer that is away loses them: those requests end by their deadline there)."""
        task = asyncio.get_running_loop().create_task(self._send(owner, entries))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, owner: str, entries: list[al.HTTPAccessLogEntry]) -> None:
        channel = self._channels.get(owner)
        if channel is None:
            channel = self._channels[owner] = grpc.aio.insecure_channel(owner)
        message = als_pb2.StreamAccessLogsMessage()
        message.http_logs.log_entry.extend(entries)
        stub = als_pb2_grpc.AccessLogServiceStub(channel)
        try:
            await stub.StreamAccessLogs(iter([message]), timeout=SEND_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("%d access-log lines for %s not delivered: %s", len(entries), owner, exc)

    async def close(self) -> None:
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
