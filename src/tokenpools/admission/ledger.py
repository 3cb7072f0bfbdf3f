"""The usage ledger as a service: the usage the store counted, written to SQL on its own loop
(every `usage.flushInterval`, backing off while the database is away; never inside a tick: a
database that blocks must not delay leases), read back for the usage API with every request
settled before the call, and flushed one last time at shutdown."""

from __future__ import annotations

import asyncio
import contextlib

from tokenpools.admission.every import Every
from tokenpools.admission.runtime import AdmissionRuntime
from tokenpools.control.store import StoreUnavailable
from tokenpools.usage.database import Bucket, LedgerUnavailable, UsageDatabase
from tokenpools.usage.flusher import Flusher, LedgerStatus


class Ledger:
    def __init__(self, admission: AdmissionRuntime) -> None:
        self.admission = admission
        u = admission.config.usage  # the database is chosen at start (a reload keeps it)
        database = UsageDatabase(u.database_url, u.deployment, u.database_timeout_s)
        durable = admission.config.state.backend == "redis"  # pending usage outlives us
        self.flusher = Flusher(
            admission.background, admission.core, database, admission.clock, durable
        )
        self._loop = Every("usage flush", self._wait_s, self._flush_quietly)

    def _wait_s(self) -> float:
        return self.flusher.backoff_s(self.admission.config.usage.flush_interval_s)

    async def _flush_quietly(self) -> None:
        # counted and logged by the flusher; the rows stay pending
        with contextlib.suppress(LedgerUnavailable, StoreUnavailable):
            await self.flusher.flush(self._pools())

    def _pools(self) -> list[str]:
        return list(self.admission.config.pools)

    async def flush(self) -> int:
        """Write the usage the store counted and SQL does not have yet; rows written. Raises
        LedgerUnavailable (or StoreUnavailable) when it cannot: the rows stay pending."""
        # a safety net only: the database's own timeouts end a stuck flush first, counted
        timeout_s = 2 * self.admission.config.usage.database_timeout_s + 1
        try:
            return await asyncio.wait_for(self.flusher.flush(self._pools()), timeout_s)
        except TimeoutError:
            raise LedgerUnavailable(
                f"usage database {self.flusher.database.name}: timed out"
            ) from None

    def status(self) -> LedgerStatus:
        return self.flusher.status()

    async def usage(self, start: float, end: float) -> list[Bucket]:
        """The ledger's buckets of hours in [start, end), with every request settled before
        the call; LedgerUnavailable names why not."""
        try:
            await self.flush()
        except StoreUnavailable as exc:  # what SQL has is still an answer... but not all of it
            raise LedgerUnavailable(f"state store unreachable: {exc}") from exc
        return await asyncio.to_thread(self.flusher.database.read, start, end)

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        """The last flush (what cannot be written is left in a durable store, or logged),
        then the database closed."""
        await self._loop.stop()
        timeout_s = 2 * self.admission.config.usage.database_timeout_s
        await self.flusher.final(self._pools(), timeout_s)
        await self.flusher.aclose()
