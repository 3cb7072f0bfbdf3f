"""The admission runtime's periodic jobs, one service on its own loop (every tick interval):
the core's tick (leases expired, debts and priorities updated; what the shared store is owed
sent first, and the local budget's leases handed over to it), then, each on its own timer of
the injected clock, the snapshot its samplers read (once per update period: the dashboard's
history) and the renewal of the leases of requests in flight (four times per lease TTL: a
lease lost ends its request). Tests drive `tick` by hand."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from tokenpools.admission.every import Due, Every
from tokenpools.admission.runtime import AdmissionRuntime
from tokenpools.control.snapshot import Snapshot
from tokenpools.control.store import StoreUnavailable


class PeriodicJobs:
    def __init__(self, admission: AdmissionRuntime) -> None:
        self.admission = admission
        self.samplers: list[Callable[[Snapshot], None]] = []  # one snapshot per update period
        self._sampling = Due(lambda: admission.policy.update_period_s)
        self._renewing = Due(lambda: admission.policy.lease_ttl_s / 4)
        self._loop: Every | None = None

    async def tick(self) -> None:
        admission = self.admission
        now = admission.clock()
        await admission.advance(now)
        if self.samplers and self._sampling(now):
            with contextlib.suppress(StoreUnavailable):
                snap = await admission.background(admission.snapshot, now)
                for sample in self.samplers:
                    sample(snap)
        if self._renewing(now):
            await admission.renew(now)

    @property
    def running(self) -> bool:
        return self._loop is not None

    def start(self, tick_interval_s: float) -> None:
        self._loop = Every("tick", lambda: tick_interval_s, self.tick)
        self._loop.start()

    async def stop(self) -> None:
        if self._loop is not None:
            await self._loop.stop()
            self._loop = None
