"""The requests the ext_authz service let on, each held under a ticket until Envoy's access
log says how it ended: settled on the usage the log carries, released by its status, or —
its line never come (the log stream broken, Envoy gone) — ended by the ticket's deadline,
charged its whole reservation. A ticket ends once: a line sent again after a reconnect, or one
for a ticket that has expired, changes nothing."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tokenpools.admission.access_log import RequestRecord
from tokenpools.admission.front_door import Cleared
from tokenpools.authz.peers import OWNER_END
from tokenpools.model.request import Usage

log = logging.getLogger("tokenpools.authz")
CLIENT_GONE = 499  # the client went away before an answer
# how a held request ended: its log line came, its deadline passed, the service stopped
SettledBy = Literal["log", "deadline", "stopped"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended, as Envoy's access log tells it (authz/log_service.py)."""

    status: int  # the answer's; 0: none was sent (the client or the upstream went away)
    usage: Usage | None  # the engine's, lifted from its answer; None: the answer carried none
    duration_s: float | None = None
    ttft_s: float | None = None  # to the answer's first byte


@dataclass(slots=True)
class Held:
    cleared: Cleared
    record: RequestRecord
    deadline: float


class Settlements:
    def __init__(
        self,
        finished: Callable[[RequestRecord], None],
        clock: Callable[[], float],
        timeout_s: float,
        ended: Callable[[SettledBy], None] = lambda how: None,
        owner: str | None = None,
    ) -> None:
        """`finished`: where each request's record goes once it has ended (the access log
        and the metrics); `timeout_s`: how long a ticket waits for its log line (longer than
        the longest request the route allows, plus the logger's flush interval); `ended`:
        told how each held request ended (the metrics); `owner`: this replica's access-log
        address, named in its tickets so that another replica can send their lines on
        (peers.py)."""
        self.finished, self.clock, self.timeout_s = finished, clock, timeout_s
        self.ended = ended
        self._prefix = "" if owner is None else owner + OWNER_END
        self._held: dict[str, Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, cleared: Cleared, record: RequestRecord) -> str:
        """A request let on: its ticket (random, so no client can name another's)."""
        ticket = self._prefix + secrets.token_urlsafe(18)
        self._held[ticket] = Held(cleared, record, self.clock() + self.timeout_s)
        return ticket

    def settle(self, ticket: str, outcome: Outcome) -> bool:
        """End a held request as its log line says; False: no such ticket held (never one
        of ours, or ended already)."""
        held = self._held.pop(ticket, None)
        if held is None:
            return False
        admitted, record = held.cleared.admitted, held.record
        if outcome.status == 200:
            # no usage in a whole answer: an engine that sends none in a stream, or an answer
            # cut short; charged its whole reservation, as the gateway charges what it cannot see
            admitted.end(outcome.usage, refund=False)
        else:  # an error answer, or none: refunded unless the engine may have run it
            admitted.end(None, refund=outcome.status not in (0, 504))
        record.status = outcome.status or CLIENT_GONE
        if outcome.duration_s is not None:
            record.duration_s = outcome.duration_s
        record.ttft_s = outcome.ttft_s
        self._close(held, "log")
        return True

    def expire(self) -> int:
        """End the tickets whose log line is overdue (charged in full: the request may have
        run to its end); returns how many."""
        now = self.clock()
        overdue = [t for t, held in self._held.items() if held.deadline <= now]
        for ticket in overdue:
            held = self._held.pop(ticket)
            log.warning(
                "request %s: no access-log line within %.0f s; charged its whole reservation",
                held.record.request_id,
                self.timeout_s,
            )
            held.cleared.admitted.end(None, refund=False)
            self._close(held, "deadline")
        return len(overdue)

    def abandon_all(self) -> None:
        """The service stops: what is still held ends now (charged in full), so no lease is
        left for its TTL to find."""
        for held in self._held.values():
            held.cleared.admitted.end(None, refund=False)
            self._close(held, "stopped")
        self._held.clear()

    def _close(self, held: Held, how: SettledBy) -> None:
        a = held.cleared.admitted
        a.close()
        held.record.settled(a.usage, a.charge, a.evicted)
        self.finished(held.record)
        self.ended(how)
