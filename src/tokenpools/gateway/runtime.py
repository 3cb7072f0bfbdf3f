"""The gateway's running state: the decision core and its store, the backend pools, the
requests in flight (which eviction cancels), ticks, lease renewal and capacity feedback.
Work that touches the store goes through `GatewayLedger`, so the event loop never waits on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web

from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.feedback import next_fraction
from tokenpools.control.snapshot import snapshot
from tokenpools.control.store import Lease, StoreUnavailable
from tokenpools.gateway.backend_tokens import PoolCounter
from tokenpools.gateway.backends import BackendPool
from tokenpools.gateway.history import History
from tokenpools.gateway.ledger import GatewayLedger
from tokenpools.gateway.metrics import GatewayMetrics
from tokenpools.gateway.observe import RequestObserver
from tokenpools.gateway.responses import bearer
from tokenpools.gateway.tracing import Tracing
from tokenpools.model.config import Config
from tokenpools.model.keys import key_matches
from tokenpools.model.request import RequestCost
from tokenpools.openai_api import vllm_gauges
from tokenpools.state.memory import MemoryStore

log = logging.getLogger("tokenpools.gateway")


@dataclass
class AdmittedRequest:
    """A request between admission and settlement; eviction cancels its task."""

    task: asyncio.Task[Any] | None
    lease: Lease
    evicted: bool = False


def open_core(config: Config, now: float, replica: str) -> GatewayLedger:
    """The decision core on the store the config names, and the gateway's way to it."""
    settings = config.state
    if settings.backend == "memory":
        local = MemoryStore(counters_on_admit=True)  # every answer's x-ratelimit-* headers
        return GatewayLedger(DecisionCore(config, local, now=now, replica=replica))
    from tokenpools.state.redis_store import RedisStore  # redis-py only where it is used

    store = RedisStore(
        settings.url,
        timeout_s=settings.timeout_s,
        retry_interval_s=settings.retry_interval_s,
        prefix=settings.key_prefix,
        owner=replica,
        replica_timeout_s=settings.replica_timeout_s,
    )
    # The private store holds what the outage policy admits while Redis is unreachable.
    core = DecisionCore(config, store, now=now, replica=replica, fallback_store=MemoryStore())
    return GatewayLedger(core, store.hot_path())


def replica_name() -> str:
    """Unique per process start: lease ids begin with it, and a restarted replica must not
    reuse the ids its previous life left in a shared store."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class Gateway:
    config: Config
    clock: Callable[[], float] = time.time
    replica: str = field(default_factory=replica_name)
    core: DecisionCore = field(init=False)
    pools: dict[str, BackendPool] = field(init=False)
    admitted_requests: dict[str, AdmittedRequest] = field(default_factory=dict)  # by lease id
    metrics: GatewayMetrics = field(init=False)
    session: aiohttp.ClientSession | None = None
    capacity_fraction: dict[str, float] = field(default_factory=dict)  # from capacity feedback
    access_log: bool = True
    tracing: Tracing | None = None  # OpenTelemetry spans, when asked for (the otel extra)

    def __post_init__(self) -> None:
        self.ledger = open_core(self.config, self.clock(), self.replica)
        self.core = self.ledger.core
        self._next_renewal = 0.0
        self.pools = {name: BackendPool(p.backends) for name, p in self.config.pools.items()}
        self.counters = self._counters(self.config)
        self.metrics = GatewayMetrics(self)
        self.history = History(self.replica)
        self._next_sample = 0.0
        self._background: list[asyncio.Task[None]] = []  # what `start` started
        self.observe = RequestObserver(self.metrics, self.history, self.access_log)
        self.model_pool = self._models(self.config)

    @staticmethod
    def _counters(config: Config) -> dict[str, PoolCounter]:
        """Each pool's prompt counter; a tokenizer file that cannot be read is a ConfigError."""
        g = config.gateway
        return {
            name: PoolCounter(pool.tokenizer, g.chars_per_token, g.tokenize_timeout_s)
            for name, pool in config.pools.items()
        }

    async def prompt_tokens(self, pool: str, body: dict[str, Any], path: str) -> int:
        return await self.counters[pool].count(body, path, self.pools[pool], self.session)

    @staticmethod
    def _models(config: Config) -> dict[str, str]:
        return {m: p.name for p in config.pools.values() for m in p.models}

    async def reload(self, config: Config) -> None:
        """Adopt a validated config; leases of removed entitlements end their requests. The
        state backend is chosen at start: a change of it waits for a restart."""
        if config.state != self.config.state:
            log.warning("the state section changed: it takes effect at the next restart")
            config = replace(config, state=self.config.state)
        counters = self._counters(config)  # first: an unreadable tokenizer or backend key
        pools = {}  # rejects the reload before anything changes
        for name, pool in config.pools.items():
            fresh = BackendPool(pool.backends)  # reads the keys again: a rotated key is adopted
            keep = self.pools.get(name)
            if keep is not None and [b.spec for b in keep.backends] == list(pool.backends):
                for kept, new in zip(keep.backends, fresh.backends, strict=True):
                    kept.auth = new.auth  # health and requests in flight carry over
                fresh = keep
            pools[name] = fresh
        for lease in await self.ledger.background(self.core.apply_config, config, self.clock()):
            self.evict(lease.lease_id)
        self.pools = pools
        self.counters = counters
        self.config = config
        self.model_pool = self._models(config)

    def evict(self, lease_id: str) -> None:
        handle = self.admitted_requests.get(lease_id)
        if handle is not None and not handle.evicted:
            handle.evicted = True
            if handle.task is not None:  # without one, its host checks `evicted` itself
                handle.task.cancel()

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
            change = await self.ledger.background(
                self.core.set_capacity,
                pool_name,
                self.clock(),
                None,
                pool.per_replica.scale(fraction),
            )
            log.warning(
                "pool %s: capacity at %.0f%% (engine waiting %g, KV %.2f)",
                pool_name,
                100 * fraction,
                waiting,
                kv,
            )
            for lease in change.evict:
                self.evict(lease.lease_id)

    async def tick(self) -> None:
        now = self.clock()
        await self.ledger.send_unsent()
        await self.ledger.hand_over(now)
        result = await self.ledger.background(self.core.tick, now)
        for lease in result.expired:
            self.evict(lease.lease_id)
        if now >= self._next_sample:  # the dashboard's history: one sample per update period
            self._next_sample = now + self.core.policy.update_period_s
            with contextlib.suppress(StoreUnavailable):
                self.history.sample(await self.ledger.background(snapshot, self.core, now))
        if now >= self._next_renewal:  # keep our leases alive; a lost one ends its request
            self._next_renewal = now + self.core.policy.lease_ttl_s / 4
            handles = list(self.admitted_requests.items())
            alive = await asyncio.gather(*(self.ledger.renew(h.lease, now) for _, h in handles))
            for (lease_id, _), renewed in zip(handles, alive, strict=True):
                if not renewed:
                    self.evict(lease_id)

    async def start(self, tick_interval_s: float, health_interval_s: float) -> None:
        """Open the upstream session and the store, and start the background work: ticks,
        backend health checks, capacity feedback (until `stop`)."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector)
        await self.ledger.start()
        self._background = [
            asyncio.create_task(self._ticking(tick_interval_s)),
            asyncio.create_task(self._checking_health(health_interval_s)),
            asyncio.create_task(self._feeding_back()),
        ]

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.ledger.aclose()
        if self.session is not None:
            await self.session.close()

    async def _ticking(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.tick()
            except Exception:  # a bad tick must not end ticking for good
                log.exception("tick failed")

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

    def pool_for(self, entitlement: str, model: object) -> str | None:
        """The pool serving `model` if the entitlement may use it (its own pool), else None."""
        pool = self.model_pool.get(model) if isinstance(model, str) else None
        return pool if pool == self.core.entitlements[entitlement].ent.pool else None

    async def admit(self, entitlement: str, cost: RequestCost) -> Decision:
        """Decide, count the decision, and end the preemptible requests an admission evicts."""
        now = self.clock()
        decision = await self.ledger.admit(entitlement, cost, now)
        self.metrics.decided(entitlement, decision)
        self.history.decided(entitlement, decision, now)
        if isinstance(decision, Admit):
            for victim in decision.evict:
                self.evict(victim.lease_id)
        return decision

    def entitlement_of(self, request: web.Request) -> str | None:
        """The entitlement whose API key the request bears; None for none or an unknown one."""
        key = bearer(request)
        return self.core.entitlement_for_key(key) if key else None

    def is_admin(self, request: web.Request) -> bool:
        key = bearer(request)
        return key is not None and any(
            key_matches(key, h) for h in self.config.gateway.admin_key_hashes
        )


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
HEALTH_INTERVAL = web.AppKey("health_interval_s", float)
# more /readyz checks a host adds (each returns its problems; none: ready)
READY_CHECKS: web.AppKey[list[Any]] = web.AppKey("ready_checks", list)
