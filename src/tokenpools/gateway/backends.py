"""The inference servers behind each pool: their credentials, least-in-flight routing and
health."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import aiohttp

from tokenpools.model.config import ConfigError
from tokenpools.model.pool import Backend

log = logging.getLogger("tokenpools.gateway")


class BackendState:
    __slots__ = ("auth", "healthy", "open_requests", "spec")

    def __init__(self, spec: Backend) -> None:
        self.spec = spec
        self.open_requests = 0
        self.healthy = True
        key = api_key(spec)
        self.auth = {} if key is None else {"Authorization": f"Bearer {key}"}


def api_key(spec: Backend) -> str | None:
    """The backend's API key from where the config says it is; a ConfigError names what is
    missing, so a start or reload without the key fails before any request is sent."""
    if spec.api_key is not None:
        return spec.api_key
    if spec.api_key_env is not None:
        key = os.environ.get(spec.api_key_env, "").strip()
        if not key:
            raise ConfigError(
                f"backend {spec.url}: environment variable {spec.api_key_env} is unset or empty"
            )
        return key
    if spec.api_key_file is not None:
        try:
            key = Path(spec.api_key_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"backend {spec.url}: cannot read apiKeyFile: {exc}") from None
        if not key:
            raise ConfigError(f"backend {spec.url}: apiKeyFile {spec.api_key_file} is empty")
        return key
    return None


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
                    f"{b.spec.url}/health", headers=b.auth, timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    ok = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok != b.healthy:
                log.warning("backend %s is %s", b.spec.url, "up" if ok else "down")
            b.healthy = ok

        await asyncio.gather(*(probe(b) for b in self.backends))
