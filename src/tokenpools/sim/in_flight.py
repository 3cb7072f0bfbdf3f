"""Admitted attempts from admission to their end: each goes to a replica (at once, or when a
policy that queues requests itself releases it), its engine steps it to its first token and
completion, or the policy has it evicted. The clients hear how each ended.

A policy that queues (llm-d's flow control) is asked for attempts to release until it releases
none, then for what it decided besides (refusals, evictions, a later cycle it wants): the
dispatch cycle, run after every admission it queued, every engine step and every tick.

A policy that suspends (sim/suspension.py) has its evictions suspend attempts instead: they
leave the engine, keep their output, and are resumed whenever room may have returned.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from tokenpools.engine.model import StepResult
from tokenpools.sim.clients import Clients
from tokenpools.sim.policy import AdmissionPolicy, Queue, Send, SimRequest
from tokenpools.sim.records import Attempt
from tokenpools.sim.replicas import Replicas
from tokenpools.sim.suspension import Suspension
from tokenpools.sim.timeline import Timeline


class InFlight:
    def __init__(
        self,
        *,
        policy: AdmissionPolicy,
        timeline: Timeline,
        replicas: Replicas,
        clients: Clients,
    ) -> None:
        self.policy, self.timeline = policy, timeline
        self.replicas, self.clients = replicas, clients
        self.attempts: dict[str, Attempt] = {}  # by request id, admitted and not yet ended
        self.segments: dict[str, SimRequest] = {}  # a resumed attempt's continuation, by id
        self.suspension = Suspension(
            policy=policy,
            timeline=timeline,
            replicas=replicas,
            clients=clients,
            resumed=self._resumed,
        )
        self._wakes: set[float] = set()  # dispatch cycles the policy asked for

    def admitted(self, attempt: Attempt, verdict: Send | Queue) -> None:
        """The policy admitted an attempt: its victims go, then it goes to a replica now
        (Send) or waits in the policy's queues (Queue)."""
        self.attempts[attempt.req.req_id] = attempt
        for victim in verdict.evict:
            self.evict(victim)
        if isinstance(verdict, Send):
            self.send(attempt.req)
        else:
            self.dispatch()

    def _resumed(self, attempt: Attempt, req: SimRequest, verdict: Send) -> None:
        """A suspended attempt's continuation was admitted: its victims go, then it goes to
        a replica, under the continuation's id."""
        self.attempts[req.req_id] = attempt
        self.segments[req.req_id] = req
        for victim in verdict.evict:
            self.evict(victim)
        self.send(req)

    def send(self, req: SimRequest) -> None:
        index = self.replicas.route(req)
        attempt = self.attempts.get(req.req_id)
        if attempt is not None and attempt.started_at is None:
            attempt.started_at = self.timeline.now
        if not self.replicas.busy[index]:
            self._step(index)

    # -- engine steps ---------------------------------------------------------------------

    def _step(self, index: int) -> None:
        result = self.replicas.step(index, self.timeline.now)
        if result is not None:
            self.timeline.at(
                self.timeline.now + result.duration_s, lambda: self._step_done(index, result)
            )

    def _step_done(self, index: int, result: StepResult) -> None:
        now = self.timeline.now
        for req_id in result.first_tokens:
            attempt = self.attempts.get(req_id)
            if attempt is not None and attempt.first_token_at is None:
                attempt.first_token_at = now
        for seq in result.finished:
            attempt = self.attempts.pop(seq.req_id, None)
            self.replicas.finished(seq.req_id)
            if attempt is None:
                continue
            req = self.segments.pop(seq.req_id, attempt.req)
            if req.continues:
                attempt.recomputed_tokens += seq.prompt_tokens - seq.cached
            attempt.outcome, attempt.finished_at = "completed", now
            attempt.output_tokens += seq.generated
            self.policy.finished(req, seq.generated, now)
            self.clients.job_done(attempt.job)
        self._step(index)
        if self.policy.holds_requests:
            self.dispatch()
        if result.finished:  # room may have returned
            self.suspension.resume()

    # -- ends before completion -----------------------------------------------------------

    def evict(self, req_id: str) -> None:
        """The policy takes an attempt's room back: suspended, if the policy suspends, else
        ended."""
        if self.policy.suspends:
            self._suspend(req_id)
        else:
            self.end(req_id)

    def evict_all(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.evict(req_id)

    def end(self, req_id: str) -> None:
        """End an attempt before it completes: what it generated is thrown away, its client
        retries or gives up."""
        attempt = self.attempts.pop(req_id, None)
        req = self.segments.pop(req_id, None)
        done = self.replicas.abort(req_id)
        if attempt is None:
            return
        now = self.timeline.now
        attempt.output_tokens += done.generated
        if attempt.started_at is not None:  # the work thrown away (its KV grew linearly)
            held = now - attempt.started_at - attempt.suspended_s
            attempt.wasted_slot_s = held
            attempt.wasted_kv_token_s = held * (
                attempt.req.prompt_tokens + attempt.output_tokens / 2
            )
        attempt.outcome, attempt.reason, attempt.finished_at = "evicted", "evicted", now
        self.policy.ended_early(req or attempt.req, now)
        self.clients.retry_or_give_up(attempt.job, None)

    def end_all(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.end(req_id)

    def _suspend(self, req_id: str) -> None:
        attempt = self.attempts.pop(req_id, None)
        req = self.segments.pop(req_id, None)
        replica = self.replicas.where(req_id)
        done = self.replicas.abort(req_id)
        if attempt is None:
            return
        attempt.output_tokens += done.generated
        if req is not None:
            attempt.recomputed_tokens += done.prefilled
        self.policy.ended_early(req or attempt.req, self.timeline.now)
        self.suspension.suspend(attempt, replica)

    def _refuse_queued(self, req_id: str, reason: str) -> None:
        attempt = self.attempts.pop(req_id, None)
        if attempt is not None:
            self.clients.refused_in_queue(attempt, reason)

    # -- the dispatch cycle of a policy that queues -----------------------------------------

    def dispatch(self) -> None:
        """Ask the policy for queued attempts until it releases none (it may release one at a
        time and read the engines again), then act on what it decided besides."""
        now = self.timeline.now
        while released := self.policy.dispatch(now, self.replicas.free_slots):
            for req in released:
                self.send(req)
        self.aftermath()

    def aftermath(self) -> None:
        """Act on the refusals and evictions the policy decided outside `admit`."""
        after = self.policy.aftermath(self.timeline.now)
        for req_id, reason in after.refuse:
            self._refuse_queued(req_id, reason)
        self.evict_all(after.evict)
        if after.evict or after.refuse:  # room was made: the policy may release more
            self.dispatch()
        elif after.wake_at is not None and after.wake_at not in self._wakes:
            self._wakes.add(after.wake_at)  # one wake-up per instant, however often asked
            self.timeline.at(after.wake_at, partial(self._wake, after.wake_at))

    def _wake(self, at: float) -> None:
        self._wakes.discard(at)
        self.dispatch()
