"""The flusher: every flush interval, the usage buckets the store counted since the last
flush are taken (one step per pool, by whichever replica comes first) and written to SQL. Rows
that cannot be written go back to the store, to be taken again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tokenpools.admission.driver import StoreDriver
from tokenpools.control.store import StoreUnavailable, UsageRow
from tokenpools.usage.database import UsageDatabase

log = logging.getLogger("tokenpools.usage")


class Flusher:
    def __init__(self, driver: StoreDriver, database_url: str, clock: Callable[[], float]) -> None:
        self.driver, self.clock = driver, clock
        self.database_url = database_url
        self._db: UsageDatabase | None = None
        self._lock = asyncio.Lock()
        self.written = 0  # rows, since start

    async def database(self) -> UsageDatabase:
        if self._db is None:
            self._db = await asyncio.to_thread(UsageDatabase, self.database_url)
        return self._db

    async def flush(self, pools: list[str]) -> int:
        """Take and write what changed; returns the rows written."""
        async with self._lock:  # one flush at a time: a row taken is written before the next
            db = await self.database()
            written = 0
            for pool in pools:
                now = self.clock()
                try:
                    rows: list[UsageRow] = await self.driver.background(
                        self.driver.core.store.take_usage, pool, now
                    )
                except StoreUnavailable:
                    continue  # taken next time
                if not rows:
                    continue
                try:
                    written += await asyncio.to_thread(db.write, rows)
                except Exception:
                    log.exception(
                        "usage: writing %d rows to %s failed", len(rows), self.database_url
                    )
                    await self.driver.background(
                        self.driver.core.store.put_back_usage, pool, rows, self.clock()
                    )
                    raise
            self.written += written
            return written

    async def aclose(self) -> None:
        if self._db is not None:
            await asyncio.to_thread(self._db.close)
