"""A job on its own asyncio task, run once per period (read again before each wait: a reload
may change it) until stopped. A run that fails is logged and the next one comes: a bad run
must not end the job for good."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("tokenpools.admission")


class Every:
    def __init__(
        self, name: str, period_s: Callable[[], float], job: Callable[[], Awaitable[object]]
    ) -> None:
        self.name, self.period_s, self.job = name, period_s, job
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s())
            try:
                await self.job()
            except Exception:
                log.exception("%s failed", self.name)


class Due:
    """A timer on the injected clock: due at most once per period, first at the first look."""

    def __init__(self, period_s: Callable[[], float]) -> None:
        self.period_s = period_s
        self._next = float("-inf")

    def __call__(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self.period_s()
        return True
