"""Faults to inject between a gateway and its store, for the tests that show a booked admission
always ends: a loopback TCP proxy that can delay, pause, cut and restore a connection; SIGSTOP
and SIGCONT of a redis-server; and a blocking callback that stalls an event loop.

The proxy runs its own event loop in a thread, so it keeps its schedule while the loop it
serves is stalled."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator


class FaultProxy:
    """Forwards 127.0.0.1:`port` to `target_port`, both ways, with the fault of the moment:
    `delay` each chunk, `pause` (hold every byte until `resume`), `cut` (drop every connection,
    and those that come, until `restore`)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.delay_s = 0.0
        self._open = asyncio.Event()  # set: bytes flow
        self._cut = False
        self._links: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._open.set()
        server = self.loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()
        server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._links |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )
        for w in (writer, up_writer):
            self._links.discard(w)
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                await self._open.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def _do(self, fn: object) -> None:
        self.loop.call_soon_threadsafe(fn)  # type: ignore[arg-type]

    def delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def pause(self) -> None:
        self._do(self._open.clear)

    def resume(self) -> None:
        self._do(self._open.set)

    def cut(self) -> None:
        def cut() -> None:
            self._cut = True
            for writer in list(self._links):
                writer.transport.abort()

        self._do(cut)

    def restore(self) -> None:
        def restore() -> None:
            self._cut = False
            self.delay_s = 0.0
            self._open.set()

        self._do(restore)

    def close(self) -> None:
        async def shutdown() -> None:
            self._cut = True
            for writer in list(self._links):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def fault_proxy(target_port: int) -> Iterator[FaultProxy]:
    proxy = FaultProxy(target_port)
    try:
        yield proxy
    finally:
        proxy.close()


def sigstop(proc: subprocess.Popen[bytes] | int) -> None:
    os.kill(proc if isinstance(proc, int) else proc.pid, signal.SIGSTOP)


def sigcont(proc: subprocess.Popen[bytes] | int) -> None:
    os.kill(proc if isinstance(proc, int) else proc.pid, signal.SIGCONT)


def stall(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Block `loop` for `seconds` from its next turn, as a slow callback or a long garbage
    collection does (safe to call from any thread)."""
    loop.call_soon_threadsafe(time.sleep, seconds)
