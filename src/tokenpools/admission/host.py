"""What a host beside a data plane runs (the ext_proc processor, the ext_authz service): the
admission runtime (the same runtime, store and budgets as the gateway's, so every host's
replicas enforce one pool together), its periodic jobs, the usage ledger, the budget notices,
the metrics, the front door and the access log; readiness, a config adopted while running, a
start and a stop. Each host adds only its own wire (extproc/flow.py, authz/check.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenpools.admission.access_log import RequestObserver, RequestRecord
from tokenpools.admission.budget_notices import BudgetNotices
from tokenpools.admission.front_door import FrontDoor
from tokenpools.admission.jobs import PeriodicJobs
from tokenpools.admission.ledger import Ledger
from tokenpools.admission.metrics import AdmissionMetrics
from tokenpools.admission.runtime import AdmissionRuntime
from tokenpools.model.config import Config


class AdmissionHost:
    def __init__(
        self,
        config: Config,
        clock: Callable[[], float] = time.time,
        access_log: bool = True,
        rewrites: bool = True,
        ends: bool = True,
    ) -> None:
        """`rewrites`: the host can send on a body other than the client's; `ends`: it can
        end a request while it runs (ext_authz can neither: admission/front_door.py)."""
        self.config = config
        self.admission = AdmissionRuntime(config, clock)
        self.jobs = PeriodicJobs(self.admission)
        self.ledger = Ledger(self.admission)
        self.notices = BudgetNotices(self.admission)
        self.metrics = AdmissionMetrics(self.admission, self.ledger)
        self.admission.listeners.append(self.metrics.decided)
        self.door = FrontDoor(self.admission, self.metrics, clock, rewrites=rewrites, ends=ends)
        self.observe = RequestObserver([self.metrics.finished], access_log=access_log)
        # more reasons not to be ready, from the config's source (a cluster watch gone stale)
        self.ready_checks: list[Callable[[], list[str]]] = []

    def finished(self, record: RequestRecord) -> None:
        """A request is over: its access line and its metrics."""
        self.observe.request(record)

    async def reload(self, config: Config) -> Config:
        """Adopt a validated config (the file followed, or SIGHUP), as `tokenpools serve` does."""
        self.config = await self.admission.reload(config)
        self.door.adopt()
        return self.config

    async def start(self, tick_interval_s: float) -> None:
        await self.admission.start()
        self.jobs.start(tick_interval_s)
        self.ledger.start()
        self.notices.start()

    async def stop(self) -> None:
        await self.jobs.stop()
        await self.notices.stop()
        await self.ledger.stop()
        await self.admission.stop()

    async def unready(self) -> list[str]:
        """Why it should not be sent requests now (none: ready to admit)."""
        if not self.admission.running:
            return ["not started"]
        why = [reason for check in self.ready_checks for reason in check()]
        if not await self.admission.store_answers():
            why.append("the shared state store does not answer")
        return why

    async def ready(self) -> bool:
        """Ready to admit: started, its config's source current, and the store answers."""
        return not await self.unready()
