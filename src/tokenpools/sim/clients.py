"""The tenants' clients in the simulation: open-loop arrivals and closed-loop clients, each
request's attempts through the admission policy, retries after a refusal or an eviction, and
giving up."""

from __future__ import annotations

import itertools
from collections import Counter
from functools import partial
from typing import TYPE_CHECKING

from tokenpools.sim.policy import Queue, Refuse, Send
from tokenpools.sim.records import Attempt, Job, new_job
from tokenpools.sim.scenario import Tenant, Workload
from tokenpools.sim.workload import backoff_s, next_gap, workload_at

if TYPE_CHECKING:
    from tokenpools.sim.simulator import Simulation

MIN_WAIT_S = 0.001  # a refused client waits at least this long: time must move between tries


class Clients:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.tenants = sim.tenants
        self.rng = sim.rng
        self._ids = itertools.count(1)
        self.attempts: list[Attempt] = []
        self.gave_up: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # since the last sample
        self.low_priority: Counter[str] = Counter()

    def start(self) -> None:
        for name, tenant in self.tenants.items():
            w = tenant.workload
            if w.arrivals.kind == "closed":
                for client in range(w.arrivals.clients or 0):
                    self.sim.at(w.start_s, partial(self.new_job, name, client))
            else:
                self.sim.at(w.start_s, partial(self._open_arrival, name))

    def _active(self, tenant: Tenant) -> bool:
        w, now = tenant.workload, self.sim.now
        return w.start_s <= now and (w.end_s is None or now < w.end_s)

    def _open_arrival(self, name: str) -> None:
        tenant = self.tenants[name]
        if not self._active(tenant):
            return
        self.new_job(name, None)
        w, factor = workload_at(tenant, self.sim.now)
        a = w.arrivals
        rate = a.rate if a.rate is not None else (a.slots or 0) / self._service_s(w)
        self.sim.at(
            self.sim.now + next_gap(a.kind, rate * factor, a.cv, self.rng[name]),
            lambda: self._open_arrival(name),
        )

    def _service_s(self, w: Workload) -> float:
        return self.sim.profile.nominal_service_s(
            round(w.prompt.mean_value()), round(w.output.mean_value())
        )

    def new_job(self, name: str, client: int | None) -> None:
        tenant = self.tenants[name]
        if self._active(tenant):
            self._send(new_job(tenant, self.rng[name], self.sim.now, client))

    def _send(self, job: Job) -> None:
        sim = self.sim
        job.tries += 1
        tenant = self.tenants[job.tenant]
        req = job.request(
            f"{job.tenant}-{next(self._ids)}", tenant.entitlement or tenant.name, sim.now
        )
        attempt = Attempt(req, job, job.tries)
        self.attempts.append(attempt)
        verdict = sim.policy.admit(req, sim.now)
        if isinstance(verdict, Refuse):
            attempt.outcome, attempt.reason = "rejected", verdict.reason
            attempt.finished_at = sim.now
            self.rejected[job.tenant] += 1
            if verdict.reason == "low_priority":
                self.low_priority[job.tenant] += 1
            self.retry_or_give_up(job, verdict.retry_after_s)
            return
        sim.active[req.req_id] = attempt
        for victim in verdict.evict:
            sim.evict(victim)
        if isinstance(verdict, Send):
            sim.to_engine(req)
        else:
            assert isinstance(verdict, Queue)
            sim.dispatch_queued()

    def refused_in_queue(self, req_id: str, reason: str) -> None:
        """The policy gave up on an attempt it had queued (a queue time-out): the client gets
        its refusal now, without Retry-After."""
        attempt = self.sim.active.pop(req_id, None)
        if attempt is None:
            return
        attempt.outcome, attempt.reason, attempt.finished_at = "rejected", reason, self.sim.now
        self.rejected[attempt.job.tenant] += 1
        self.retry_or_give_up(attempt.job, None)

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
        self.sim.at(self.sim.now + wait, lambda: self._send(job))

    def job_done(self, job: Job, wait_s: float = 0.0) -> None:
        """A job ended (completed, or given up): its closed-loop client thinks, then sends."""
        if job.client is not None:
            think = self.tenants[job.tenant].workload.arrivals.think_s
            self.sim.at(
                self.sim.now + max(think, wait_s), lambda: self.new_job(job.tenant, job.client)
            )
