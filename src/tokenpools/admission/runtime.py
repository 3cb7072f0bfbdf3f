"""The admission runtime an asyncio host stands on: the decision core on its store (through
the `StoreDriver`), the requests in flight (an `Admitted` each, by lease id), and the
background work — ticks, the renewal of long requests' leases, config and capacity changes —
each of which may end requests in flight (evicted, expired). Metrics, history and logs hear
about decisions as listeners; the runtime knows no HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from tokenpools.admission.admitted import Admitted
from tokenpools.admission.driver import StoreDriver, check_cluster_budgets, open_driver
from tokenpools.control.budgets import Budgets, budget_status
from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.layers import charged_to
from tokenpools.control.snapshot import Snapshot, snapshot
from tokenpools.control.store import StoreUnavailable
from tokenpools.control.tenancy import Caller, Directory, Route
from tokenpools.control.views import EntitlementView
from tokenpools.model.config import Config
from tokenpools.model.policy import Policy
from tokenpools.model.request import RequestCost, Usage
from tokenpools.model.resources import Resources
from tokenpools.tokenizing.counter import PromptCounter
from tokenpools.usage.database import Bucket, LedgerUnavailable, UsageDatabase
from tokenpools.usage.flusher import Flusher, LedgerStatus
from tokenpools.usage.notices import Notifier

log = logging.getLogger("tokenpools.admission")
T = TypeVar("T")
DecisionListener = Callable[[str, Decision, float], None]  # entitlement, decision, now


def replica_name() -> str:
    """Unique per process start: lease ids begin with it, and a restarted replica must not
    reuse the ids its previous life left in a shared store."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class AdmissionRuntime:
    def __init__(
        self,
        config: Config,
        clock: Callable[[], float] = time.time,
        replica: str | None = None,
    ) -> None:
        self.config, self.clock = config, clock
        self.replica = replica or replica_name()
        self.driver: StoreDriver = open_driver(config, clock(), self.replica)
        self.core = self.driver.core
        self.in_flight: dict[str, Admitted] = {}  # by lease id
        self.listeners: list[DecisionListener] = []
        self.samplers: list[Callable[[Snapshot], None]] = []  # one snapshot per update period
        self._next_renewal = self._next_sample = 0.0
        self._next_notice = clock() + config.usage.flush_interval_s
        u = config.usage
        database = UsageDatabase(u.database_url, u.deployment, u.database_timeout_s)
        durable = config.state.backend == "redis"  # its pending usage outlives this process
        self.flusher = Flusher(self.driver.background, self.core.store, database, clock, durable)
        self.notifier = Notifier()
        self._ticking: asyncio.Task[None] | None = None
        self._flushing: asyncio.Task[None] | None = None
        self.directory = Directory(config)  # who calls, and where their requests go
        self.counters = _counters(config)  # prompt tokens, per pool

    # -- requests ------------------------------------------------------------------------

    async def admit(self, entitlement: str | Sequence[str], cost: RequestCost) -> Decision:
        """Decide, tell the listeners, and end the preemptible requests an admission evicts.
        Several entitlements: the request's layers, in order (control/layers.py); the one that
        admits it is charged (`decision.lease.entitlement`), a refusal is counted on the first."""
        names = (entitlement,) if isinstance(entitlement, str) else entitlement
        now = self.clock()
        decision = await self.driver.admit(names, cost, now)
        charged = charged_to(decision, names)
        for listener in self.listeners:
            listener(charged, decision, now)
        if isinstance(decision, Admit):
            for victim in decision.evict:
                self.evict(victim.lease_id)
        return decision

    def track(self, decision: Admit, task: asyncio.Task[Any] | None) -> Admitted:
        """The admitted request, in flight until it ends (`task` is cancelled on eviction)."""
        admitted = Admitted(decision.lease, task, self._end)
        self.in_flight[decision.lease.lease_id] = admitted
        return admitted

    def _end(self, admitted: Admitted, usage: Usage | None, refund: bool) -> None:
        self.in_flight.pop(admitted.lease.lease_id, None)
        ending = self.driver.end(admitted.lease, usage, self.clock(), refund=refund)
        admitted.charge = ending.charge

    def evict(self, lease_id: str) -> None:
        admitted = self.in_flight.pop(lease_id, None)
        if admitted is not None:
            admitted.evict()

    def route(self, caller: Caller, model: object) -> Route | None:
        """The pool serving `model` and the caller's layers there; None if it may not use it."""
        return self.directory.route(caller, model)

    # -- reads a host may make ------------------------------------------------------------
    # The store reads (`snapshot`, `budget_status`) may wait on a shared store: a host calls
    # them through `background`, off its event loop.

    def snapshot(self, now: float) -> Snapshot:
        return snapshot(self.core, now)

    def budget_status(self, now: float) -> list[dict[str, Any]]:
        return budget_status(self.core, now)

    async def background(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn` where it may wait on the store: inline on the memory store, on the
        driver's worker thread on a shared one."""
        return await self.driver.background(fn, *args)

    async def store_answers(self) -> bool:
        return await self.driver.store_answers(self.clock())

    @property
    def entitlements(self) -> Mapping[str, EntitlementView]:
        """The entitlements as configured and bound, by name."""
        return self.core.entitlements

    @property
    def budgets(self) -> Budgets:
        return self.core.budgets

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @property
    def fallback_in_flight(self) -> int:
        """Requests admitted on this replica's local budget while the store was away."""
        return len(self.core.fallback.leases)

    # -- changes -------------------------------------------------------------------------

    async def reload(self, config: Config) -> Config:
        """Adopt a validated config; requests of removed entitlements end. The store is chosen
        at start: a changed state section waits for a restart. Returns the config adopted."""
        if config.state != self.config.state:
            log.warning("the state section changed: it takes effect at the next restart")
            config = replace(config, state=self.config.state)
        old, new = self.config.usage, config.usage
        if (old.database_url, old.deployment) != (new.database_url, new.deployment):
            log.warning("usage.database and usage.deployment take effect at the next restart")
        counters = _counters(config)  # first: an unreadable tokenizer file rejects the reload
        check_cluster_budgets(config)
        for lease in await self.driver.background(self.core.apply_config, config, self.clock()):
            self.evict(lease.lease_id)
        self.config, self.directory, self.counters = config, Directory(config), counters
        return config

    async def set_capacity(self, pool: str, per_replica: Resources) -> None:
        """A pool's replicas now give `per_replica` each (capacity feedback): the preemptible
        requests that no longer fit end."""
        change = await self.driver.background(
            self.core.set_capacity, pool, self.clock(), None, per_replica
        )
        for lease in change.evict:
            self.evict(lease.lease_id)

    # -- time ----------------------------------------------------------------------------

    async def tick(self) -> None:
        now = self.clock()
        await self.driver.send_unsent()
        await self.driver.hand_over(now)
        result = await self.driver.background(self.core.tick, now)
        for lease in result.expired:
            self.evict(lease.lease_id)
        if self.samplers and now >= self._next_sample:  # one snapshot per update period
            self._next_sample = now + self.core.policy.update_period_s
            with contextlib.suppress(StoreUnavailable):
                snap = await self.driver.background(snapshot, self.core, now)
                for sample in self.samplers:
                    sample(snap)
        if now >= self._next_notice:  # budget thresholds crossed
            self._next_notice = now + self.config.usage.flush_interval_s
            webhook = self.config.usage.webhook
            await self.notifier.check(self.core, self.driver.background, webhook, now)
        if now >= self._next_renewal:  # keep our leases alive; a lost one ends its request
            self._next_renewal = now + self.core.policy.lease_ttl_s / 4
            held = list(self.in_flight.values())
            alive = await asyncio.gather(*(self.driver.renew(a.lease, now) for a in held))
            for admitted, renewed in zip(held, alive, strict=True):
                if not renewed:
                    self.evict(admitted.lease.lease_id)

    async def flush_usage(self) -> int:
        """Write the usage the store counted and SQL does not have yet; rows written. Raises
        LedgerUnavailable (or StoreUnavailable) when it cannot: the rows stay pending."""
        # a safety net only: the database's own timeouts end a stuck flush first, counted
        timeout_s = 2 * self.config.usage.database_timeout_s + 1
        try:
            return await asyncio.wait_for(self.flusher.flush(list(self.config.pools)), timeout_s)
        except TimeoutError:
            raise LedgerUnavailable(
                f"usage database {self.flusher.database.name}: timed out"
            ) from None

    def ledger_status(self) -> LedgerStatus:
        return self.flusher.status()

    async def usage(self, start: float, end: float) -> list[Bucket]:
        """The ledger's buckets of hours in [start, end), with every request settled before
        the call; LedgerUnavailable names why not."""
        try:
            await self.flush_usage()
        except StoreUnavailable as exc:  # what SQL has is still an answer... but not all of it
            raise LedgerUnavailable(f"state store unreachable: {exc}") from exc
        return await asyncio.to_thread(self.flusher.database.read, start, end)

    @property
    def running(self) -> bool:
        return self._ticking is not None

    async def start(self, tick_interval_s: float) -> None:
        await self.driver.start()
        self._ticking = asyncio.create_task(self._tick_every(tick_interval_s))
        self._flushing = asyncio.create_task(self._flush_every())

    async def stop(self) -> None:
        for task in (self._ticking, self._flushing):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._ticking = self._flushing = None
        pools = list(self.config.pools)
        await self.flusher.final(pools, 2 * self.config.usage.database_timeout_s)
        await self.driver.aclose()
        await self.flusher.aclose()
        await self.notifier.aclose()

    async def _flush_every(self) -> None:
        """The usage ledger to SQL, beside the ticks (never inside one: a database that blocks
        must not delay leases), backing off while the database is away."""
        while True:
            await asyncio.sleep(self.flusher.backoff_s(self.config.usage.flush_interval_s))
            try:
                await self.flusher.flush(list(self.config.pools))
            except (LedgerUnavailable, StoreUnavailable):
                pass  # counted and logged by the flusher; the rows stay pending
            except Exception:  # a bad flush must not end flushing for good
                log.exception("usage flush failed")

    async def _tick_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.tick()
            except Exception:  # a bad tick must not end ticking for good
                log.exception("tick failed")


def _counters(config: Config) -> dict[str, PromptCounter]:
    """Each pool's prompt counter; a tokenizer file that cannot be read is a ConfigError."""
    g = config.gateway
    return {name: PromptCounter(p.tokenizer, g.chars_per_token) for name, p in config.pools.items()}
