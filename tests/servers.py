"""Real servers on loopback ports for end-to-end tests: each runs its own event loop in a
thread, so tests drive it with ordinary (blocking) clients such as the official openai one."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from tokenpools.gateway.http_layer import GatewayRunner

T = TypeVar("T")


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
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(30)
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
        # what it left on its loop ends here, not garbage-collected inside a later test
        asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _cancel_the_rest() -> None:
    """Cancel what a stopped server left on its loop (an emulator's engine, a handler still
    closing) and let it finish: a task left pending is garbage-collected later, in whichever
    test runs then, and logs "Task was destroyed but it is pending!" there."""
    current = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not current]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


def wait_for(
    read: Callable[[], T],
    until: Callable[[T], object] = bool,
    *,
    what: str,
    timeout_s: float = 20.0,
    every_s: float = 0.01,
) -> T:
    """Poll `read()` until `until(value)` holds and return that value: how a test waits for
    what the server does after it has answered (a lease ended, a row written, a counter
    moved), never for a fixed time. After `timeout_s` it fails naming `what` it awaited and
    the last value it saw."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if until(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what} (last seen: {_shown(value)})")
        time.sleep(every_s)


def wait_until(
    condition: Callable[[], object], timeout_s: float = 20.0, what: str | None = None
) -> None:
    """Poll a condition until it holds (synchronising on state, not on time); wait_for's
    failure names the condition by `what`, or by its source line."""
    wait_for(condition, bool, what=what or _source(condition), timeout_s=timeout_s)


def _source(fn: Callable[..., object]) -> str:
    try:
        return " ".join(inspect.getsource(fn).split())
    except (OSError, TypeError):
        return repr(fn)


def _shown(value: object, limit: int = 500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
