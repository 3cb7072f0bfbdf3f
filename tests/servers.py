"""Real servers on loopback ports for end-to-end tests: each runs its own event loop in a
thread, so tests drive it with ordinary (blocking) clients such as the official openai one."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tokenpools.gateway.http_layer import GatewayRunner


class ServerThread:
    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("server did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = GatewayRunner(self.app, handler_cancellation=True, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the server's loop and return its result (to read state safely)."""

        async def wrapper() -> Any:
            result = fn()
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(10)

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def kill(self) -> None:
        """Die like a crashed process: stop listening and drop every connection at once."""

        async def abort() -> None:
            for site in list(self.runner.sites):
                await site.stop()
            server = self.runner.server
            for handler in list(server.connections if server else []):
                if handler.transport is not None:
                    handler.transport.abort()

        asyncio.run_coroutine_threadsafe(abort(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll a condition until it holds (synchronising on state, not on time)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def free_port() -> int:
    """A loopback port nobody listens on now (for a server that takes its port as a number)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
