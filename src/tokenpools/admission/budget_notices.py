"""Budget notices as a service: on its own loop (every `usage.flushInterval`), the thresholds
the budgets' windows reached are claimed in the store, once across every replica, and sent
(logged, and POSTed to the configured webhook: usage/notices.py)."""

from __future__ import annotations

from tokenpools.admission.every import Every
from tokenpools.admission.runtime import AdmissionRuntime
from tokenpools.usage.notices import Notifier


class BudgetNotices:
    def __init__(self, admission: AdmissionRuntime, notifier: Notifier | None = None) -> None:
        self.admission = admission
        self.notifier = notifier or Notifier()
        period = lambda: admission.config.usage.flush_interval_s  # noqa: E731
        self._loop = Every("budget notices", period, self.check)

    async def check(self) -> None:
        a = self.admission
        await self.notifier.check(a.core, a.background, a.config.usage.webhook, a.clock())

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        await self.notifier.aclose()
