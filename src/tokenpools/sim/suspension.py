"""Suspended attempts, for a policy that suspends what it takes back instead of ending it
(docs/decisions.md, "Lending, and taking back"): the engine request is aborted, the client
waits on, and what was generated is kept. Whenever room may have returned (a request ended, the
policy's tick) each suspended attempt asks the policy, oldest first, to admit its continuation
— the original prompt and the output so far, asking for what is left — which goes to the
replica that holds its prefix in cache. One still suspended at its deadline ends as an evicted
attempt does: its client retries or gives up."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from tokenpools.sim.clients import Clients
from tokenpools.sim.policy import AdmissionPolicy, Refuse, Send, SimRequest
from tokenpools.sim.records import Attempt
from tokenpools.sim.replicas import Replicas
from tokenpools.sim.timeline import Timeline


@dataclass(slots=True)
class Suspended:
    attempt: Attempt
    since: float
    replica: int | None  # where its prefix is cached (None: it had not reached an engine)


class Suspension:
    def __init__(
        self,
        *,
        policy: AdmissionPolicy,
        timeline: Timeline,
        replicas: Replicas,
        clients: Clients,
        resumed: Callable[[Attempt, SimRequest, Send], None],  # InFlight takes it on
    ) -> None:
        self.policy, self.timeline = policy, timeline
        self.replicas, self.clients = replicas, clients
        self._resumed = resumed
        self.waiting: dict[str, Suspended] = {}  # by the original request id, oldest first
        self._ids = itertools.count(1)
        self._resuming = False

    def suspend(self, attempt: Attempt, replica: int | None) -> None:
        now = self.timeline.now
        attempt.suspensions += 1
        key = attempt.req.req_id
        self.waiting[key] = Suspended(attempt, now, replica)
        deadline = now + self.policy.suspend_deadline_s(attempt.req)
        self.timeline.at(deadline, lambda: self._deadline(key, now))

    def resume(self) -> None:
        """Ask the policy to admit each suspended attempt's continuation, oldest first."""
        if self._resuming or not self.waiting:
            return
        self._resuming = True  # an admission's victims are suspended while we iterate
        try:
            for key in list(self.waiting):
                held = self.waiting.get(key)
                if held is not None:
                    self._try(key, held)
        finally:
            self._resuming = False

    def _try(self, key: str, held: Suspended) -> None:
        now = self.timeline.now
        attempt = held.attempt
        req = attempt.req.continuation(f"{key}~{next(self._ids)}", attempt.output_tokens, now)
        verdict = self.policy.admit(req, now)
        if isinstance(verdict, Refuse):
            return
        assert isinstance(verdict, Send), "a policy that suspends admits at once"
        del self.waiting[key]
        attempt.suspended_s += now - held.since
        attempt.resumes += 1
        if held.replica is not None:  # its prefix is cached there
            self.replicas.pin(req.req_id, held.replica)
        self._resumed(attempt, req, verdict)

    def _deadline(self, key: str, since: float) -> None:
        held = self.waiting.get(key)
        if held is None or held.since != since:  # resumed (and maybe suspended again) since
            return
        del self.waiting[key]
        now = self.timeline.now
        attempt = held.attempt
        attempt.suspended_s += now - held.since
        attempt.outcome, attempt.reason, attempt.finished_at = "evicted", "suspended", now
        self.clients.retry_or_give_up(attempt.job, None)
