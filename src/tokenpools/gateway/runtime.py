"""The gateway's running state: admission (`AdmissionRuntime`: the decision core, its store,
the requests in flight, ticks and lease renewal) and what only an HTTP gateway has — the
backend pools and their health, the upstream session, prompt counting by the engines, capacity
feedback from the engines' gauges, metrics, the dashboard's history and tracing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from tokenpools.admission import AdmissionRuntime, FrontDoor
from tokenpools.admission.access_log import RequestObserver
from tokenpools.admission.budget_notices import BudgetNotices
from tokenpools.admission.jobs import PeriodicJobs
from tokenpools.admission.ledger import Ledger
from tokenpools.admission.metrics import AdmissionMetrics
from tokenpools.admission.runtime import replica_name
from tokenpools.control.decisions import Decision
from tokenpools.control.feedback import next_fraction
from tokenpools.gateway.backend_tokens import BackendTokens
from tokenpools.gateway.backends import BackendPool
from tokenpools.gateway.history import History
from tokenpools.gateway.metrics import GatewayCollector
from tokenpools.gateway.tracing import Tracing
from tokenpools.identity import bearer
from tokenpools.model.config import Config
from tokenpools.model.keys import key_matches
from tokenpools.model.request import RequestCost
from tokenpools.openai_api import vllm_gauges
from tokenpools.tokenizing.counter import AskBackend, PromptCounter

log = logging.getLogger("tokenpools.gateway")


@dataclass
class Gateway:
    config: Config
    clock: Callable[[], float] = time.time
    replica: str = field(default_factory=replica_name)
    pools: dict[str, BackendPool] = field(init=False)
    metrics: AdmissionMetrics = field(init=False)
    session: aiohttp.ClientSession | None = None
    capacity_fraction: dict[str, float] = field(default_factory=dict)  # from capacity feedback
    access_log: bool = True
    tracing: Tracing | None = None  # OpenTelemetry spans, when asked for (the otel extra)

    def __post_init__(self) -> None:
        # admission, and its services (each on its own loop once started)
        # the gateway suspends the lent requests the core takes back (gateway/resumable.py)
        self.admission = AdmissionRuntime(self.config, self.clock, self.replica, suspends=True)
        self.jobs = PeriodicJobs(self.admission)
        self.ledger = Ledger(self.admission)
        self.notices = BudgetNotices(self.admission)
        self.pools = {name: BackendPool(p.backends) for name, p in self.config.pools.items()}
        self.engines = BackendTokens(self.config.gateway.tokenize_timeout_s)
        self.metrics = AdmissionMetrics(self.admission, self.ledger)
        self.metrics.registry.register(GatewayCollector(lambda: self.pools))
        self.door = FrontDoor(self.admission, self.metrics, self.clock, self.ask_engine)
        self.history = History(self.replica)
        self.admission.listeners += [self.metrics.decided, self.history.decided]
        self.jobs.samplers.append(self.history.sample)
        self._background: list[asyncio.Task[None]] = []  # what `start` started
        self.observe = RequestObserver(
            [self.metrics.finished, self.history.finished], self.access_log
        )

    def ask_engine(self, pool: str) -> AskBackend:
        """How admission asks a pool's engine to count a prompt (a pool whose tokenizer is
        `backend`)."""
        return self.engines.asker(self.pools[pool], self.session)

    @property
    def counters(self) -> dict[str, PromptCounter]:
        return self.admission.counters

    async def reload(self, config: Config) -> None:
        """Adopt a validated config. The backends are built first and admission builds its
        prompt counters before it changes anything, so an unreadable backend key or tokenizer
        rejects the reload; then requests of removed entitlements end."""
        pools = {}
        for name, pool in config.pools.items():
            fresh = BackendPool(pool.backends)  # reads the keys again: a rotated key is adopted
            keep = self.pools.get(name)
            if keep is not None and [b.spec for b in keep.backends] == list(pool.backends):
                for kept, new in zip(keep.backends, fresh.backends, strict=True):
                    kept.auth = new.auth  # health and requests in flight carry over
                fresh = keep
            pools[name] = fresh
        self.config = await self.admission.reload(config)
        self.door.adopt()
        self.pools = pools
        self.engines = BackendTokens(config.gateway.tokenize_timeout_s)

    def evict(self, lease_id: str) -> None:
        self.admission.evict(lease_id)

    async def feedback(self, pool_name: str) -> None:
        """One round of capacity feedback for a pool: read its backends' vLLM gauges and move
        the pool's effective capacity by the control law."""
        pool = self.config.pools[pool_name]
        fb = pool.capacity_feedback
        if fb is None or self.session is None:
            return
        waiting = kv = 0.0
        for backend in self.pools[pool_name].backends:
            if not backend.healthy:
                continue
            try:
                async with self.session.get(
                    f"{backend.spec.url}/metrics",
                    headers=backend.auth,
                    timeout=aiohttp.ClientTimeout(total=2),
                ) as r:
                    gauges = vllm_gauges(await r.read())
            except (aiohttp.ClientError, TimeoutError):
                continue
            waiting = max(waiting, gauges.get("vllm:num_requests_waiting", 0.0))
            kv = max(kv, gauges.get("vllm:kv_cache_usage_perc", 0.0))
        current = self.capacity_fraction.get(pool_name, 1.0)
        fraction = next_fraction(current, waiting, kv, fb)
        if fraction != current:
            self.capacity_fraction[pool_name] = fraction
            await self.admission.set_capacity(pool_name, pool.per_replica.scale(fraction))
            log.warning(
                "pool %s: capacity at %.0f%% (engine waiting %g, KV %.2f)",
                pool_name,
                100 * fraction,
                waiting,
                kv,
            )

    async def tick(self) -> None:
        await self.jobs.tick()

    async def start(self, tick_interval_s: float, health_interval_s: float) -> None:
        """Open the upstream session and the store, and start the background work: ticks,
        backend health checks, capacity feedback (until `stop`)."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector)
        await self.admission.start()
        self.jobs.start(tick_interval_s)
        self.ledger.start()
        self.notices.start()
        self._background = [
            asyncio.create_task(self._checking_health(health_interval_s)),
            asyncio.create_task(self._feeding_back()),
        ]

    def drain(self) -> None:
        """Shutting down: suspended requests stop waiting for room and end at once."""
        self.admission.drain()

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.jobs.stop()
        await self.notices.stop()
        await self.ledger.stop()
        await self.admission.stop()
        if self.session is not None:
            await self.session.close()

    async def _checking_health(self, interval_s: float) -> None:
        while True:
            assert self.session is not None
            await asyncio.gather(*(p.check(self.session) for p in self.pools.values()))
            await asyncio.sleep(interval_s)

    async def _feeding_back(self) -> None:
        while True:
            intervals = {
                name: pool.capacity_feedback.interval_s
                for name, pool in self.config.pools.items()
                if pool.capacity_feedback is not None
            }
            await asyncio.sleep(min(intervals.values(), default=5.0))
            await asyncio.gather(*(self.feedback(name) for name in intervals))

    async def admit(self, entitlement: str | Sequence[str], cost: RequestCost) -> Decision:
        return await self.admission.admit(entitlement, cost)

    def is_admin(self, request: web.Request) -> bool:
        key = bearer(request.headers)
        return key is not None and any(
            key_matches(key, h) for h in self.config.gateway.admin_key_hashes
        )


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
HEALTH_INTERVAL = web.AppKey("health_interval_s", float)
# more /readyz checks a host adds (each returns its problems; none: ready)
READY_CHECKS: web.AppKey[list[Any]] = web.AppKey("ready_checks", list)
