"""The flusher: on a task of its own, each pool's pending usage rows are read from the store
(oldest first, in batches), written to SQL in one transaction, and only then acknowledged, so
a row is never marked written before its commit; a row committed but not acknowledged (the
gateway killed in between, the ack lost) is written again, which the upsert counts once.

While the database is away the rows stay pending in the store (memory: this process; Redis:
shared, 8 days) and flushes back off, doubling up to a minute; admission, leases and streams
never wait on any of it. The backlog is reported (`pending`, `oldest`) and logged."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenpools.backoff import doubled
from tokenpools.control.budgets import SEP
from tokenpools.control.metering import PendingUsage, UsageRow
from tokenpools.control.store import INF, StoreUnavailable
from tokenpools.usage.database import LedgerUnavailable, UsageDatabase

log = logging.getLogger("tokenpools.usage")
Run = Callable[..., Awaitable[Any]]  # runs a store call where the host runs them


class UsageCounts(Protocol):
    """Where the usage is counted until SQL has it: the decision core's store."""

    def pending_usage(self, pool: str, now: float, limit: int) -> PendingUsage: ...

    def ack_usage(self, pool: str, rows: Sequence[UsageRow], now: float) -> None: ...


BATCH = 500  # rows per transaction
MAX_BATCHES = 20  # per pool and flush: a long backlog drains over several flushes
MAX_BACKOFF_S = 60.0
LOG_EVERY_S = 60.0  # while the database is away: one backlog line this often


@dataclass(frozen=True, slots=True)
class LedgerStatus:
    """What an operator watches of the ledger (metrics, /admin): rows waiting in the store
    (with Redis, the pools' shared backlog as this replica last saw it), the oldest one's age,
    flushes failed and rows committed since start, and the last failure's cause."""

    pending_rows: int
    oldest_pending_s: float
    flush_failures: int
    rows_written: int
    error: str | None


class Flusher:
    def __init__(
        self,
        run: Run,
        store: UsageCounts,
        database: UsageDatabase,
        clock: Callable[[], float],
        durable: bool,
    ) -> None:
        self._run, self._store, self.database, self.clock = run, store, database, clock
        self.durable = durable  # the store outlives this process (Redis)
        self._lock = asyncio.Lock()
        self.written = 0  # rows committed, since start
        self.failures = 0  # flushes that failed, since start
        self._streak = 0  # failed in a row
        self.pending = 0  # rows waiting, at the last flush
        self.oldest = INF  # when the oldest of them first changed
        self.error: str | None = None  # why the last flush failed; None: it did not
        self._down_since = INF
        self._logged = -INF

    async def flush(self, pools: Sequence[str]) -> int:
        """Write what is pending; returns the rows committed. Raises LedgerUnavailable when
        the database cannot take them (they stay pending), StoreUnavailable likewise."""
        async with self._lock:  # one flush at a time in this process
            try:
                written = 0
                pending, oldest = 0, INF
                for pool in pools:
                    done, left = await self._flush_pool(pool)
                    written += done
                    pending += left.count
                    oldest = min(oldest, left.oldest)
            except (LedgerUnavailable, StoreUnavailable) as exc:
                self._failed(exc)
                raise
            self._recovered(written)
            self.pending, self.oldest = pending, oldest
            return written

    async def _flush_pool(self, pool: str) -> tuple[int, PendingUsage]:
        written = 0
        for _ in range(MAX_BATCHES):
            now = self.clock()
            left: PendingUsage = await self._run(self._store.pending_usage, pool, now, BATCH)
            if left.lost:
                log.error(
                    "usage: %d rows of pool %s expired in the store before SQL took them",
                    left.lost, pool,
                )  # fmt: skip
            self.pending, self.oldest = left.count, left.oldest
            if not left.rows:
                break
            await asyncio.to_thread(self.database.write, left.rows)
            await self._run(self._store.ack_usage, pool, left.rows, self.clock())
            written += len(left.rows)
            self.written += len(left.rows)
            if len(left.rows) < BATCH:
                left = PendingUsage((), max(0, left.count - len(left.rows)), INF)
                break
        return written, left

    def _failed(self, exc: Exception) -> None:
        now = self.clock()
        self.failures += 1
        self._streak += 1
        self.error = str(exc)
        if self._down_since == INF:
            self._down_since = now
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.warning(
                "usage: not written (%s); %d rows pending, the oldest for %.0f s",
                exc, self.pending, self.oldest_age_s(),
            )  # fmt: skip

    def _recovered(self, written: int) -> None:
        if self._down_since != INF:
            log.warning(
                "usage: written again after %.0f s (%d rows)",
                self.clock() - self._down_since, written,
            )  # fmt: skip
        self._down_since, self._logged, self.error, self._streak = INF, -INF, None, 0

    def status(self) -> LedgerStatus:
        return LedgerStatus(
            self.pending, self.oldest_age_s(), self.failures, self.written, self.error
        )

    def oldest_age_s(self) -> float:
        return 0.0 if self.oldest == INF else max(0.0, self.clock() - self.oldest)

    def backoff_s(self, interval_s: float) -> float:
        """How long until the next flush: the interval, doubled per failure in a row."""
        return min(MAX_BACKOFF_S, max(interval_s, doubled(interval_s, self._streak, INF)))

    async def final(self, pools: Sequence[str], timeout_s: float) -> None:
        """At shutdown: one last flush. If it fails, a durable store keeps the rows for the
        next replica; otherwise every row is logged, so no usage is lost without a record."""
        try:
            await asyncio.wait_for(self.flush(pools), timeout_s)
            return
        except (LedgerUnavailable, StoreUnavailable, TimeoutError) as exc:
            why = str(exc) or "timed out"
        if self.durable:
            log.warning("usage: not written at shutdown (%s); it stays pending in the store", why)
            return
        for pool in pools:
            left: PendingUsage = await self._run(
                self._store.pending_usage, pool, self.clock(), 1 << 30
            )
            for row in left.rows:
                log.error("usage: not written at shutdown (%s): %s", why, _record(row))

    async def aclose(self) -> None:
        await asyncio.to_thread(self.database.close)


def _record(row: UsageRow) -> str:
    """A row as one JSON line: enough to write it by hand later."""
    return json.dumps(
        {
            "source": row.source,
            "hour": row.hour,
            "bucket": row.bucket.split(SEP),
            "version": row.version,
            "values": dict(row.values),
        },
        sort_keys=True,
    )
