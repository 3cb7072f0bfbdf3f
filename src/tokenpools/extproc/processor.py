"""The ext_proc processor's running state: an admission host (admission/host.py: the runtime,
identity, metrics and access log every host beside a data plane shares) that hands Envoy's
messages to one `Flow` per HTTP request. It knows no gRPC: service.py feeds it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenpools.admission.clearing import removed_headers
from tokenpools.admission.host import AdmissionHost
from tokenpools.extproc import messages
from tokenpools.extproc.flow import Flow, FlowSettings
from tokenpools.model.config import Config

log = logging.getLogger("tokenpools.extproc")


class Processor(AdmissionHost):
    def __init__(
        self,
        config: Config,
        clock: Callable[[], float] = time.time,
        access_log: bool = True,
        duplex_answers: bool = False,
        duplex_requests: bool = False,
    ) -> None:
        super().__init__(config, clock, access_log)
        # requests' and answers' bodies come FULL_DUPLEX_STREAMED even where the data plane
        # does not say so in its protocol configuration (Envoy does; another client may not)
        self.duplex_answers = duplex_answers
        self.duplex_requests = duplex_requests
        self._told: set[str] = set()
        self.settings = self._settings(config)

    def _settings(self, config: Config) -> FlowSettings:
        """What every flow shares; per config (the trusted proxy's secret header is the
        config's): what an identified request loses, and the answer to its headers built
        once from it."""
        removed = removed_headers(config)
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

    async def reload(self, config: Config) -> Config:
        adopted = await super().reload(config)
        self.settings = self._settings(adopted)
        return adopted
