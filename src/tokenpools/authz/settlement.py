"""The requests the ext_authz service let on, each waiting under a ticket until Envoy's access
log says how it ended: settled on the usage the log carries, released by how it ended, or —
its line never come (the log stream broken, Envoy gone) — ended when the ticket is overdue,
charged its whole reservation. A ticket ends once: a line sent again after a reconnect, or one
for a ticket already ended, changes nothing."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tokenpools.admission.access_log import RequestRecord
from tokenpools.admission.admitted import Admitted
from tokenpools.authz.peers import OWNER_END
from tokenpools.model.request import Usage

log = logging.getLogger("tokenpools.authz")
CLIENT_GONE = 499  # the client went away before an answer
# how a waiting request ended: its log line came, its ticket fell overdue, the service stopped
EndedBy = Literal["log", "overdue", "stopped"]


@dataclass(frozen=True, slots=True)
class LoggedEnd:
    """How one request ended, as Envoy's access log tells it (authz/log_service.py)."""

    status: int  # the answer's; 0: none was sent (the client or the upstream went away)
    usage: Usage | None  # the engine's, lifted from its answer; None: the answer carried none
    duration_s: float | None = None
    ttft_s: float | None = None  # to the answer's first byte
    # the status is the engine's own, or nothing came from the engine: False where Envoy
    # answered in its place after the engine had answered (its answer over a buffer)
    engine_status: bool = True


@dataclass(slots=True)
class Waiting:
    admitted: Admitted
    record: RequestRecord
    due: float


class Tickets:
    def __init__(
        self,
        finished: Callable[[RequestRecord], None],
        clock: Callable[[], float],
        timeout_s: float,
        ended: Callable[[EndedBy], None] = lambda how: None,
        owner: str | None = None,
    ) -> None:
        """`finished`: where each request's record goes once it has ended (the access log
        and the metrics); `timeout_s`: how long a ticket waits for its log line (longer than
        the longest stream the route allows, plus the logger's flush interval); `ended`:
        told how each request ended (the metrics); `owner`: this replica's access-log
        address, named in its tickets so that another replica can send their lines on
        (peers.py)."""
        self.finished, self.clock, self.timeout_s = finished, clock, timeout_s
        self.ended = ended
        self._prefix = "" if owner is None else owner + OWNER_END
        self._waiting: dict[str, Waiting] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def issue(self, admitted: Admitted, record: RequestRecord) -> str:
        """A request let on: its ticket (random, so no client can name another's)."""
        ticket = self._prefix + secrets.token_urlsafe(18)
        self._waiting[ticket] = Waiting(admitted, record, self.clock() + self.timeout_s)
        return ticket

    def end_by_log(self, ticket: str, logged: LoggedEnd) -> bool:
        """End a waiting request as its log line says; False: no such ticket waits (never
        one of this replica's, or ended already)."""
        waiting = self._waiting.pop(ticket, None)
        if waiting is None:
            return False
        if logged.status == 200:
            # no usage in a whole answer: an engine that sends none in a stream, or an answer
            # cut short; charged its whole reservation, as the gateway charges what it cannot see
            waiting.admitted.end(logged.usage, refund=False)
        else:  # refunded where the engine did not run it: its own error, or no answer at all
            ran = logged.status in (0, 504) or not logged.engine_status
            waiting.admitted.end(None, refund=not ran)
        record = waiting.record
        record.status = logged.status or CLIENT_GONE
        if logged.duration_s is not None:
            record.duration_s = logged.duration_s
        record.ttft_s = logged.ttft_s
        self._close(waiting, "log")
        return True

    def end_overdue(self) -> int:
        """End the tickets whose log line is overdue (charged in full: the request may have
        run to its end); returns how many."""
        now = self.clock()
        overdue = [t for t, waiting in self._waiting.items() if waiting.due <= now]
        for ticket in overdue:
            waiting = self._waiting.pop(ticket)
            log.warning(
                "request %s: no access-log line within %.0f s; charged its whole reservation",
                waiting.record.request_id,
                self.timeout_s,
            )
            self._end_unlogged(waiting, "overdue")
        return len(overdue)

    def end_all(self) -> None:
        """The service stops: what still waits ends now (charged in full), so no lease is
        left for its TTL to find."""
        waiting, self._waiting = list(self._waiting.values()), {}
        for each in waiting:
            self._end_unlogged(each, "stopped")

    def _end_unlogged(self, waiting: Waiting, how: EndedBy) -> None:
        try:
            waiting.admitted.end(None, refund=False)
            self._close(waiting, how)
        except Exception:  # one request's end must not stop the others'
            log.exception("ending request %s failed", waiting.record.request_id)

    def _close(self, waiting: Waiting, how: EndedBy) -> None:
        a = waiting.admitted
        a.close()
        waiting.record.settled(a.usage, a.charge, a.evicted)
        self.finished(waiting.record)
        self.ended(how)
