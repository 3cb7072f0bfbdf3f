"""The ext_proc processor's running state: admission (the same runtime, store and budgets as
the gateway's, so gateway, LiteLLM and ext_proc replicas enforce one pool together), who calls
(the gateway's identity rules), the metrics and the access log. It knows no gRPC: service.py
feeds it Envoy's messages, one `Flow` per HTTP request."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenpools.admission import AdmissionRuntime, FrontDoor
from tokenpools.admission.access_log import RequestObserver, RequestRecord
from tokenpools.admission.budget_notices import BudgetNotices
from tokenpools.admission.jobs import PeriodicJobs
from tokenpools.admission.ledger import Ledger
from tokenpools.admission.metrics import AdmissionMetrics
from tokenpools.extproc import messages
from tokenpools.extproc.flow import Flow, FlowSettings
from tokenpools.model.config import Config
from tokenpools.model.objectives import SET_BY_PROCESSOR

log = logging.getLogger("tokenpools.extproc")


class Processor:
    def __init__(
        self,
        config: Config,
        clock: Callable[[], float] = time.time,
        access_log: bool = True,
        duplex_answers: bool = False,
        duplex_requests: bool = False,
    ) -> None:
        self.config = config
        # requests' and answers' bodies come FULL_DUPLEX_STREAMED even where the data plane
        # does not say so in its protocol configuration (Envoy does; another client may not)
        self.duplex_answers = duplex_answers
        self.duplex_requests = duplex_requests
        # admission, and its services (each on its own loop once started)
        self.admission = AdmissionRuntime(config, clock)
        self.jobs = PeriodicJobs(self.admission)
        self.ledger = Ledger(self.admission)
        self.notices = BudgetNotices(self.admission)
        self.metrics = AdmissionMetrics(self.admission, self.ledger)
        self.admission.listeners.append(self.metrics.decided)
        self.door = FrontDoor(self.admission, self.metrics, clock)
        self.observe = RequestObserver([self.metrics.finished], access_log=access_log)
        self._told: set[str] = set()
        # more reasons not to be ready, from the config's source (a cluster watch gone stale)
        self.ready_checks: list[Callable[[], list[str]]] = []
        self.settings = self._settings(config)

    def _settings(self, config: Config) -> FlowSettings:
        """What every flow shares; per config (the trusted proxy's secret header is the
        config's): what an identified request loses, and the answer to its headers built
        once from it."""
        removed = _removed(config)
        identified = messages.request_headers(remove=removed)
        duplex = (self.duplex_requests, self.duplex_answers)
        return FlowSettings(*duplex, removed, identified, self.misconfigured)

    def flow(self) -> Flow:
        return Flow(self.door, self.settings)

    def misconfigured(self, why: str) -> None:
        """The data plane sends bodies in a mode the processor cannot admit under: said once
        per mode (every request is refused until the filter is fixed)."""
        if why not in self._told:
            self._told.add(why)
            log.error("every request is refused: the ext_proc filter's %s", why)

    def finished(self, record: RequestRecord) -> None:
        self.observe.request(record)

    async def reload(self, config: Config) -> Config:
        """Adopt a validated config (the file followed, or SIGHUP), as `tokenpools serve` does."""
        self.config = await self.admission.reload(config)
        self.door.adopt()
        self.settings = self._settings(self.config)
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


def _removed(config: Config) -> tuple[str, ...]:
    """What an identified request loses before anyone past the processor sees it: the data
    plane's own headers and the tenant's credential (it is tokenpools', not the engine's)."""
    trusted = config.gateway.trusted_header
    secret = () if trusted is None or trusted.secret_header is None else (trusted.secret_header,)
    return (*SET_BY_PROCESSOR, "authorization", *secret)
