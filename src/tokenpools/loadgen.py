"""`tokenpools load`: replay a scenario's tenants over real HTTP against a gateway or a backend.

The clients behave as the simulator's do — open-loop (Poisson, gamma) or closed-loop arrivals,
the same length distributions, Retry-After ± jitter or exponential backoff after a 429, give up
after max_tries — and every attempt is measured client-side, as vLLM's benchmarks define it: TTFT at
the first non-empty content chunk, TPOT = (E2E − TTFT)/(tokens − 1), E2E at the end of the
stream. The result is the simulator's RunResult, so summaries, tables and figures are shared.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tokenpools.engine.profile import EngineProfile
from tokenpools.openai_api import vllm_gauges
from tokenpools.prompt import prompt_text
from tokenpools.sim.records import Attempt, Job, RunResult, Sample, new_job
from tokenpools.sim.scenario import Scenario, Tenant, Workload
from tokenpools.sim.workload import backoff_s, next_gap, workload_at


# Short words that real tokenizers (BPE with a leading space) make one token each, and that are
# ~4 characters with their space: the gateway's and the emulator's estimate.
@dataclass
class Target:
    base_url: str  # e.g. http://127.0.0.1:8080 (the gateway) or a backend
    api_key: str


@dataclass
class LoadRun:
    scenario: Scenario
    targets: dict[str, Target]  # tenant → where it sends and with which key
    model: str
    profile: EngineProfile  # converts "slots" of demand into a rate, as the simulator does
    backend_metrics_url: str | None = None  # scraped for the engine queue
    admin_url: str | None = None  # gateway admin API, for debt and priority
    admin_key: str | None = None
    label: str = "http"
    extra_body: dict[str, Any] = field(default_factory=dict)  # e.g. {"ignore_eos": True}
    timeline: list[tuple[float, Callable[[], Awaitable[None] | None]]] = field(default_factory=list)

    attempts: list[Attempt] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    output_tokens: Counter[tuple[str, str]] = field(default_factory=Counter)
    gave_up: Counter[str] = field(default_factory=Counter)

    async def run(self, progress: Callable[[float], None] | None = None) -> RunResult:
        self._t0 = time.monotonic()
        self._ids = itertools.count(1)
        self._prompts = secrets.token_hex(4)  # a real engine's prompt cache must not hit
        self._rng = {
            t.name: random.Random(f"{self.scenario.seed}/{t.name}") for t in self.scenario.tenants
        }
        self._inflight: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._low_priority: Counter[str] = Counter()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self._session = session
            tasks = [asyncio.create_task(self._tenant(t)) for t in self.scenario.tenants]
            tasks.append(asyncio.create_task(self._sampler()))
            tasks += [asyncio.create_task(self._at(t, action)) for t, action in self.timeline]
            end = self.scenario.duration_s
            while (elapsed := self.now()) < end:
                if progress is not None:
                    progress(elapsed)
                await asyncio.sleep(min(1.0, end - elapsed))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        config = self.scenario.config()
        return RunResult(
            self.scenario,
            self.label,
            self.scenario.seed,
            config,
            self.attempts,
            self.samples,
            dict(self.output_tokens),
            self.gave_up,
        )

    def now(self) -> float:
        return time.monotonic() - self._t0

    async def _at(self, t: float, action: Callable[[], Awaitable[None] | None]) -> None:
        await asyncio.sleep(max(0.0, t - self.now()))
        result = action()
        if result is not None:
            await result

    # -- clients --------------------------------------------------------------------------

    def _workload(self, tenant: Tenant) -> tuple[Workload, float]:
        return workload_at(tenant, self.now())

    async def _tenant(self, tenant: Tenant) -> None:
        w = tenant.workload
        await asyncio.sleep(max(0.0, w.start_s - self.now()))
        if w.arrivals.kind == "closed":

            async def client() -> None:
                while self._active(tenant):
                    await self._job(tenant)
                    await asyncio.sleep(w.arrivals.think_s)

            clients = [asyncio.create_task(client()) for _ in range(w.arrivals.clients or 0)]
            try:
                await asyncio.gather(*clients)
            finally:
                for c in clients:
                    c.cancel()
            return
        rng = self._rng[tenant.name]
        jobs: set[asyncio.Task[None]] = set()
        try:
            while self._active(tenant):
                task = asyncio.create_task(self._job(tenant))
                jobs.add(task)
                task.add_done_callback(jobs.discard)
                current, factor = self._workload(tenant)
                a = current.arrivals
                if a.rate is not None:
                    rate = a.rate
                else:
                    service = self.profile.nominal_service_s(
                        round(current.prompt.mean_value()), round(current.output.mean_value())
                    )
                    rate = (a.slots or 0) / service
                await asyncio.sleep(next_gap(a.kind, rate * factor, a.cv, rng))
        finally:
            for task in list(jobs):
                task.cancel()

    def _active(self, tenant: Tenant) -> bool:
        w = tenant.workload
        return w.start_s <= self.now() and (w.end_s is None or self.now() < w.end_s)

    async def _job(self, tenant: Tenant) -> None:
        rng = self._rng[tenant.name]
        job = new_job(tenant, rng, self.now())
        while True:
            job.tries += 1
            retry_after = await self._attempt(tenant, job)
            if retry_after is None:
                return
            if job.tries >= tenant.retry.max_tries:
                self.gave_up[tenant.name] += 1
                return
            wait = backoff_s(
                job.tries,
                retry_after if tenant.retry.honour_retry_after and retry_after > 0 else None,
                tenant.retry.jitter,
                rng,
            )
            await asyncio.sleep(wait)

    async def _attempt(self, tenant: Tenant, job: Job) -> float | None:
        """One HTTP request; returns None when done, else the Retry-After to wait (0: none)."""
        target = self.targets[tenant.name]
        sent = self.now()
        req = job.request(
            f"{tenant.name}-{next(self._ids)}", tenant.entitlement or tenant.name, sent
        )
        attempt = Attempt(req, job, job.tries)
        self.attempts.append(attempt)
        body = {
            **self.extra_body,
            "model": self.model,
            "messages": [
                {
                    "role": "user",
                    "content": prompt_text(job.prompt_tokens, f"{self._prompts}-{req.req_id}"),
                }
            ],
            "max_tokens": job.max_tokens,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {target.api_key}"}
        self._inflight[tenant.name] += 1
        try:
            async with self._session.post(
                f"{target.base_url}/v1/chat/completions", json=body, headers=headers
            ) as r:
                if r.status == 429:
                    attempt.outcome, attempt.finished_at = "rejected", self.now()
                    attempt.reason = await _error_code(r)
                    self._rejected[tenant.name] += 1
                    if attempt.reason == "low_priority":
                        self._low_priority[tenant.name] += 1
                    return float(r.headers.get("Retry-After", "0") or 0)
                if r.status != 200:
                    attempt.outcome, attempt.finished_at = "rejected", self.now()
                    attempt.reason = await _error_code(r)
                    self._rejected[tenant.name] += 1
                    return 0.0 if r.status >= 500 else None
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # preempted, or the backend failed
                        attempt.outcome, attempt.finished_at = "evicted", self.now()
                        attempt.reason = chunk["error"].get("code")
                        return 0.0
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("delta", {}).get("content"):
                        if attempt.first_token_at is None:
                            attempt.first_token_at = self.now()
                        attempt.output_tokens += 1
                        phase = self._phase(self.now())
                        if phase is not None:
                            self.output_tokens[(tenant.name, phase)] += 1
                attempt.outcome, attempt.finished_at = "completed", self.now()
                return None
        except (aiohttp.ClientError, TimeoutError):
            attempt.outcome, attempt.reason, attempt.finished_at = (
                "evicted",
                "connection",
                self.now(),
            )
            return 0.0
        finally:
            self._inflight[tenant.name] -= 1

    def _phase(self, t: float) -> str | None:
        return next((p.name for p in self.scenario.phases if p.start_s <= t < p.end_s), None)

    # -- samples --------------------------------------------------------------------------

    async def _sampler(self) -> None:
        while True:
            waiting = running = 0
            if self.backend_metrics_url:
                try:
                    async with self._session.get(self.backend_metrics_url) as r:
                        text = await r.read()
                    gauges = vllm_gauges(text)
                    waiting = int(gauges.get("vllm:num_requests_waiting", 0))
                    running = int(gauges.get("vllm:num_requests_running", 0))
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
            scores: dict[str, tuple[float, float]] = {}
            if self.admin_url and self.admin_key:
                try:
                    async with self._session.get(
                        f"{self.admin_url}/admin/entitlements",
                        headers={"Authorization": f"Bearer {self.admin_key}"},
                    ) as r:
                        ents = await r.json()
                    for t in self.scenario.tenants:
                        e = ents.get(t.entitlement or t.name)
                        if e is not None:
                            scores[t.name] = (e["debt"], e["priority"])
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
            self.samples.append(
                Sample(
                    t=self.now(),
                    waiting=waiting,
                    running=running,
                    slots=self.profile.max_num_seqs,
                    kv_usage=0.0,
                    running_by_tenant={k: v for k, v in self._inflight.items() if v},
                    scores=scores,
                    rejected_by_tenant=dict(self._rejected),
                    low_priority_by_tenant=dict(self._low_priority),
                )
            )
            self._rejected.clear()
            self._low_priority.clear()
            await asyncio.sleep(self.scenario.sample_interval_s)


async def _error_code(response: aiohttp.ClientResponse) -> str | None:
    try:
        payload = await response.json(content_type=None)
        code = payload.get("error", {}).get("code")
        return str(code) if code is not None else f"http_{response.status}"
    except (ValueError, aiohttp.ClientError):
        return f"http_{response.status}"
