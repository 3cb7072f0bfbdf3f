"""The ext_authz service's running state: an admission host (admission/host.py: the runtime,
identity, metrics and access log every host beside a data plane shares), the checks Envoy asks
(check.py) and the requests they let on, waiting under a ticket until the access log ends them
(settlement.py, log_service.py). It knows no HTTP or gRPC server: server.py feeds it."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from tokenpools.admission.clearing import removed_headers
from tokenpools.admission.host import AdmissionHost
from tokenpools.authz.check import Checker
from tokenpools.authz.log_service import AccessLogService
from tokenpools.authz.peers import Peers
from tokenpools.authz.settlement import Tickets
from tokenpools.model.config import Config

# How long a request let on waits for its access-log line before it is charged in full:
# longer than the longest answer the route allows (docs/envoy.md), plus the logger's flush.
SETTLE_TIMEOUT_S = 3600.0


class Authorizer(AdmissionHost):
    def __init__(
        self,
        config: Config,
        clock: Callable[[], float] = time.time,
        access_log: bool = True,
        settle_timeout_s: float = SETTLE_TIMEOUT_S,
        peers: Peers | None = None,
        ticket_header: bool = False,
    ) -> None:
        """`peers`: the other replicas behind the same Service, to which the access-log
        lines of their tickets are sent on (None: a lone replica); `ticket_header`: the
        ticket goes on as a request header and is logged back (log_service.py)."""
        super().__init__(config, clock, access_log, rewrites=False, ends=False)
        self.peers = peers
        registry = self.metrics.registry
        ended = Counter(
            "tokenpools_authz_ended",
            "Requests ext_authz let on, ended: by their access-log line, their ticket overdue, "
            "or the service's stop",
            ["by"],
            registry=registry,
        )
        self.tickets = Tickets(
            self.finished,
            clock,
            settle_timeout_s,
            lambda how: ended.labels(how).inc(),
            None if peers is None else peers.own,
        )
        waiting = Gauge(
            "tokenpools_authz_waiting",
            "Requests let on, waiting for their access-log line",
            registry=registry,
        )
        waiting.set_function(lambda: len(self.tickets))
        self.checker = Checker(self.door, self.tickets, self.finished, removed_headers(config))
        self.log_service = AccessLogService(self.tickets, peers, ticket_header)
        self.draining = False  # stopping: not ready, still answering

    async def reload(self, config: Config) -> Config:
        adopted = await super().reload(config)
        self.checker = Checker(self.door, self.tickets, self.finished, removed_headers(adopted))
        return adopted

    async def unready(self) -> list[str]:
        why = await super().unready()
        return ["stopping", *why] if self.draining else why

    async def stop(self) -> None:
        self.tickets.end_all()
        if self.peers is not None:
            await self.peers.close()
        await super().stop()
