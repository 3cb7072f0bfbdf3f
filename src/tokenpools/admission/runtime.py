"""The admission runtime an asyncio host stands on: the decision core on its store (through
the `StoreDriver`), the requests in flight (an `Admitted` each, by lease id), and what may end
them — an admission's evictions, config and capacity changes, the core's tick, a lease lost.
The host composes it with its services, each on its own loop: the periodic jobs (jobs.py),
the usage ledger (ledger.py), the budget notices (budget_notices.py). Metrics, history and
logs hear about decisions as listeners; the runtime knows no HTTP."""

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

from tokenpools.admission.admitted import Admitted, Cancellable
from tokenpools.admission.driver import StoreDriver, check_cluster_budgets, open_driver
from tokenpools.control.budgets import Budgets, budget_status
from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.layers import charged_to
from tokenpools.control.snapshot import Snapshot, snapshot
from tokenpools.control.tenancy import Directory
from tokenpools.control.views import EntitlementView, PoolView
from tokenpools.model.config import Config
from tokenpools.model.policy import Policy
from tokenpools.model.request import RequestCost, Usage
from tokenpools.model.resources import Resources
from tokenpools.tokenizing.counter import PromptCounter

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
        suspends: bool = False,
    ) -> None:
        """`suspends`: the host suspends the lent requests the core takes back and resumes
        them (the gateway); otherwise they are ended (control/core.py)."""
        self.config, self.clock = config, clock
        self.replica = replica or replica_name()
        self.driver: StoreDriver = open_driver(config, clock(), self.replica, suspends)
        self._room = asyncio.Event()  # set, and replaced, whenever a request here ends
        self.draining = False  # the host is stopping: nobody waits for room any more
        self.core = self.driver.core
        self.in_flight: dict[str, Admitted] = {}  # by lease id
        self.listeners: list[DecisionListener] = []
        self.running = False  # started, not stopped
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

    def track(self, decision: Admit, task: Cancellable | None) -> Admitted:
        """The admitted request, in flight until it ends (`task` is cancelled on eviction)."""
        admitted = Admitted(decision.lease, task, self._end, self._recharge)
        self.in_flight[decision.lease.lease_id] = admitted
        return admitted

    def _end(self, admitted: Admitted, usage: Usage | None, refund: bool) -> None:
        self.in_flight.pop(admitted.lease.lease_id, None)
        ending = self.driver.end(admitted.lease, usage, self.clock(), refund=refund)
        admitted.charge = ending.charge
        self._room_freed()

    def _recharge(self, admitted: Admitted, usage: Usage) -> None:
        self.driver.recharge(admitted.lease, usage, self.clock())

    def evict(self, lease_id: str) -> None:
        admitted = self.in_flight.pop(lease_id, None)
        if admitted is not None:
            admitted.evict()

    def _room_freed(self) -> None:
        self._room.set()
        self._room = asyncio.Event()

    def drain(self) -> None:
        """The host is stopping: requests waiting for room stop waiting (a suspended one ends
        as taken back, at once, instead of holding the shutdown until its deadline)."""
        self.draining = True
        self._room_freed()

    async def room(self, timeout_s: float) -> None:
        """Wait until a request this process admitted ends, or `timeout_s` (room freed by
        another replica is only seen then): when a suspended request asks again."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room.wait(), max(0.0, timeout_s))

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
    def pools(self) -> Mapping[str, PoolView]:
        """The pools as configured, with their capacity now, by name."""
        return self.core.pools

    @property
    def budgets(self) -> Budgets:
        return self.core.budgets

    @property
    def policy(self) -> Policy:
        return self.core.policy

    @property
    def fallback_in_flight(self) -> int:
        """Requests admitted on this replica's local budget while the store was away."""
        return len(self.core.local_leases())

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

    # -- time (admission/jobs.py calls these) ---------------------------------------------

    async def advance(self, now: float) -> None:
        """The core's tick, after what the shared store is owed and the local budget's leases
        handed over to it; the requests whose leases expired end."""
        await self.driver.send_unsent()
        await self.driver.hand_over(now)
        result = await self.driver.background(self.core.tick, now)
        for lease in result.expired:
            self.evict(lease.lease_id)

    async def renew(self, now: float) -> None:
        """Keep the leases of the requests in flight alive; a lost one ends its request."""
        held = list(self.in_flight.values())
        alive = await asyncio.gather(*(self.driver.renew(a.lease, now) for a in held))
        for admitted, renewed in zip(held, alive, strict=True):
            if not renewed:
                self.evict(admitted.lease.lease_id)

    async def start(self) -> None:
        await self.driver.start()
        self.running = True

    async def stop(self) -> None:
        """Wait for the lease ends in flight, then close the store's connections."""
        self.running = False
        await self.driver.aclose()


def _counters(config: Config) -> dict[str, PromptCounter]:
    """Each pool's prompt counter; a tokenizer file that cannot be read is a ConfigError."""
    g = config.gateway
    return {name: PromptCounter(p.tokenizer, g.chars_per_token) for name, p in config.pools.items()}
