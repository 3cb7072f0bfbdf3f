"""The tenants' clients in the simulation: open-loop arrivals and closed-loop clients, each
request's attempts through the admission policy, retries after a refusal or an eviction, and
giving up. What becomes of an admitted attempt is sim/in_flight.py's; it tells the clients how
each ended."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from functools import partial

from tokenpools.engine.profile import EngineProfile
from tokenpools.sim.policy import AdmissionPolicy, Queue, Refuse, Send
from tokenpools.sim.records import Attempt, Job, new_job
from tokenpools.sim.scenario import Tenant, Workload
from tokenpools.sim.timeline import Timeline
from tokenpools.sim.workload import backoff_s, next_gap, workload_at

MIN_WAIT_S = 0.001  # a refused client waits at least this long: time must move between tries


class Clients:
    """Every tenant's clients: the jobs they make, each attempt (`attempts`, in the order
    sent), the jobs given up, and the refusals since the last sample."""

    def __init__(
        self,
        tenants: dict[str, Tenant],
        *,
        seed: int,
        profile: EngineProfile,  # what a request's service takes (arrival rates given in slots)
        timeline: Timeline,
        policy: AdmissionPolicy,
        admitted: Callable[[Attempt, Send | Queue], None],  # where admitted attempts go
    ) -> None:
        self.tenants = tenants
        self.profile, self.timeline, self.policy = profile, timeline, policy
        self._admitted = admitted
        # Every draw of a tenant's clients (arrival gaps, lengths, backoff jitter) comes from
        # its own source, seeded by the run's seed and its name: tenants never shift each
        # other's draws.
        self.rng = {name: random.Random(f"{seed}/{name}") for name in tenants}
        self._ids = itertools.count(1)
        self.attempts: list[Attempt] = []
        self.gave_up: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()  # since the last call of `refusals`
        self._low_priority: Counter[str] = Counter()

    def start(self) -> None:
        for name, tenant in self.tenants.items():
            w = tenant.workload
            if w.arrivals.kind == "closed":
                for client in range(w.arrivals.clients or 0):
                    self.timeline.at(w.start_s, partial(self.new_job, name, client))
            else:
                self.timeline.at(w.start_s, partial(self._open_arrival, name))

    def _active(self, tenant: Tenant) -> bool:
        w, now = tenant.workload, self.timeline.now
        return w.start_s <= now and (w.end_s is None or now < w.end_s)

    def _open_arrival(self, name: str) -> None:
        tenant = self.tenants[name]
        if not self._active(tenant):
            return
        self.new_job(name, None)
        w, factor = workload_at(tenant, self.timeline.now)
        a = w.arrivals
        rate = a.rate if a.rate is not None else (a.slots or 0) / self._service_s(w)
        self.timeline.at(
            self.timeline.now + next_gap(a.kind, rate * factor, a.cv, self.rng[name]),
            lambda: self._open_arrival(name),
        )

    def _service_s(self, w: Workload) -> float:
        return self.profile.nominal_service_s(
            round(w.prompt.mean_value()), round(w.output.mean_value())
        )

    def new_job(self, name: str, client: int | None) -> None:
        tenant = self.tenants[name]
        if self._active(tenant):
            self._send(new_job(tenant, self.rng[name], self.timeline.now, client))

    def _send(self, job: Job) -> None:
        now = self.timeline.now
        job.tries += 1
        tenant = self.tenants[job.tenant]
        req = job.request(f"{job.tenant}-{next(self._ids)}", tenant.entitlement or tenant.name, now)
        attempt = Attempt(req, job, job.tries)
        self.attempts.append(attempt)
        verdict = self.policy.admit(req, now)
        if isinstance(verdict, Refuse):
            attempt.outcome, attempt.reason = "rejected", verdict.reason
            attempt.finished_at = now
            self._rejected[job.tenant] += 1
            if verdict.reason == "low_priority":
                self._low_priority[job.tenant] += 1
            self.retry_or_give_up(job, verdict.retry_after_s)
            return
        self._admitted(attempt, verdict)

    def refused_in_queue(self, attempt: Attempt, reason: str) -> None:
        """The policy gave up on an attempt it had queued (a queue time-out): the client gets
        its refusal now, without Retry-After."""
        attempt.outcome, attempt.reason, attempt.finished_at = "rejected", reason, self.timeline.now
        self._rejected[attempt.job.tenant] += 1
        self.retry_or_give_up(attempt.job, None)

    def refusals(self) -> tuple[dict[str, int], dict[str, int]]:
        """Refusals per tenant since the last call (each sample's): all of them, and those
        for low priority; the counts start again from zero."""
        counted = dict(self._rejected), dict(self._low_priority)
        self._rejected.clear()
        self._low_priority.clear()
        return counted

    def retry_or_give_up(self, job: Job, retry_after_s: float | None) -> None:
        retry = self.tenants[job.tenant].retry
        gives_up = job.tries >= retry.max_tries
        if gives_up and job.client is None:  # open loop: nobody waits on this job any more
            self.gave_up[job.tenant] += 1
            return
        wait = backoff_s(
            job.tries,
            retry_after_s if retry.honour_retry_after else None,
            retry.jitter,
            self.rng[job.tenant],
        )
        if gives_up:
            self.gave_up[job.tenant] += 1
            # A closed-loop client that gives up still waits what it was told before its next
            # request: asking again at the same instant would be refused again, for ever.
            self.job_done(job, max(wait, MIN_WAIT_S))
            return
        self.timeline.at(self.timeline.now + wait, lambda: self._send(job))

    def job_done(self, job: Job, wait_s: float = 0.0) -> None:
        """A job ended (completed, or given up): its closed-loop client thinks, then sends."""
        if job.client is not None:
            think = self.tenants[job.tenant].workload.arrivals.think_s
            self.timeline.at(
                self.timeline.now + max(think, wait_s), lambda: self.new_job(job.tenant, job.client)
            )
