"""The inference servers behind each pool: least-in-flight routing and health."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from tokenpools.model.pool import Backend

log = logging.getLogger("tokenpools.gateway")


class BackendState:
    __slots__ = ("healthy", "open_requests", "spec")

    def __init__(self, spec: Backend) -> None:
        self.spec = spec
        self.open_requests = 0
        self.healthy = True


class BackendPool:
    def __init__(self, backends: tuple[Backend, ...]) -> None:
        self.backends = [BackendState(b) for b in backends]

    def choose(self) -> BackendState | None:
        """The healthy backend with the fewest requests in flight; None when all are down."""
        best = None
        for b in self.backends:
            if b.healthy and (best is None or b.open_requests < best.open_requests):
                best = b
        return best

    async def check(self, session: aiohttp.ClientSession) -> None:
        """One round of health checks: GET {url}/health (vLLM, llama.cpp, the emulator)."""

        async def probe(b: BackendState) -> None:
            try:
                async with session.get(
                    f"{b.spec.url}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    ok = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok != b.healthy:
                log.warning("backend %s is %s", b.spec.url, "up" if ok else "down")
            b.healthy = ok

        await asyncio.gather(*(probe(b) for b in self.backends))
