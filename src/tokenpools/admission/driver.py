"""The store driver: how an asyncio host runs the decision core on its store, so the event
loop never waits on the network.

With the embedded memory store every call runs inline: nothing waits. With a shared store
(Redis), the request path (admit, settle, release, renew) awaits one round trip each through
the store's asyncio client, with the core deciding before and after (`prepare`, `decide`); the
background work (ticks, reloads, capacity changes, metrics and admin reads), several calls each,
runs on one worker thread, one piece at a time, so it never runs alongside itself."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from tokenpools.control.budgets import Budgets
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Decision
from tokenpools.control.endings import Ending
from tokenpools.control.metering import Charge
from tokenpools.control.store import Lease, Outcome, StoreUnavailable
from tokenpools.model.config import Config, ConfigError
from tokenpools.model.request import RequestCost, Usage
from tokenpools.state.memory import MemoryStore

if TYPE_CHECKING:
    from tokenpools.state.redis.hot_path import RedisHotPath

T = TypeVar("T")


class StoreDriver:
    def __init__(self, core: DecisionCore, shared: RedisHotPath | None = None) -> None:
        self.core = core
        self.shared = shared
        self._worker = (
            None if shared is None else ThreadPoolExecutor(1, thread_name_prefix="tokenpools")
        )
        self._ending: set[asyncio.Task[None]] = set()
        if shared is not None:
            core.hand_over_by_host()  # `hand_over` does it, on the loop

    async def admit(self, names: Sequence[str], cost: RequestCost, now: float) -> Decision:
        """A request of one entitlement, or of several layers (control/layers.py): the
        admission pipeline (control/pipeline.py), each store step awaited on a shared store."""
        if self.shared is None:
            return self.core.admit(names, cost, now)
        flow = self.core.admission(names, cost, now)
        try:
            steps = next(flow)
            while True:
                try:
                    tried: list[Outcome] | None = await self.shared.admit_first(steps, now)
                except StoreUnavailable:
                    tried = None
                steps = flow.send(tried)
        except StopIteration as done:
            decision: Decision = done.value
            return decision

    def end(self, lease: Lease, usage: Usage | None, now: float, refund: bool = True) -> Ending:
        """Settle a finished request on its usage, or release it (no usage: `refund` or charge
        the whole reservation). With a shared store the call is a task of its own, so a
        request cancelled mid-way still ends its lease. Returns what it charges."""
        ending = self.core.prepare_end(lease, usage, refund)
        if self.shared is None or ending.local:
            self.core.end_on_store(ending, now)
            return ending
        self._in_background(self._end(ending, now))
        return ending

    def _in_background(self, step: Coroutine[Any, Any, None]) -> None:
        """A store step that must happen even if its request is cancelled: a task of its own,
        awaited by `aclose`."""
        task = asyncio.get_running_loop().create_task(step)
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _end(self, ending: Ending, now: float) -> None:
        assert self.shared is not None
        try:
            if ending.charged is None:
                await self.shared.release(ending.lease, now, refund=ending.refund)
            else:
                await self.shared.settle(ending.lease, ending.charged, now, ending.charge)
        except StoreUnavailable:  # ours is sent when Redis answers; another's expires there
            return
        self.core.ended(ending, now)

    def recharge(self, lease: Lease, usage: Usage, now: float) -> None:
        """A lease taken back on its worst case is charged `usage` instead (a suspended
        request's segment, once its output is known); on a shared store a task of its own,
        like an end."""
        if self.shared is None:
            self.core.recharge(lease, usage, now)
            return
        charge = self.core.charge(lease, usage)
        if charge is None:
            return
        self._in_background(self._recharge(lease, charge, now))

    async def _recharge(self, lease: Lease, charge: Charge, now: float) -> None:
        assert self.shared is not None
        with contextlib.suppress(StoreUnavailable):  # the worst case stays charged
            await self.shared.recharge(lease, charge, now)

    async def renew(self, lease: Lease, now: float) -> bool:
        """False: the lease has ended elsewhere (evicted by another replica, or expired)."""
        expires_at, local = self.core.renewal(lease.lease_id, now)
        if self.shared is None or local:
            return self.core.renew(lease.lease_id, now)
        try:
            return await self.shared.renew(lease, expires_at, now)
        except StoreUnavailable:  # keep running; the store is asked again next time
            return True

    async def send_unsent(self) -> None:
        """The lease ends the shared store is owed go on the request path's connection, ahead
        of anything decided after them (a tick's work included)."""
        if self.shared is not None:
            with contextlib.suppress(StoreUnavailable):
                await self.shared.send_unsent()

    async def hand_over(self, now: float) -> None:
        """Book in the shared store the leases admitted on the local budget while it was away,
        on the event loop, where their requests end: a request that ended while its lease was
        on its way there has its end owed to the store, sent ahead of the next decision."""
        local = self.core.local_leases()
        if self.shared is None or not local:
            return
        for lease in list(local.values()):
            if lease.lease_id not in local:
                continue  # it ended meanwhile
            try:
                await self.shared.adopt(lease, now)
            except StoreUnavailable:
                return  # the next tick tries again
            if not self.core.handed_over(lease, now):
                self.shared.store.given_up(lease, now)  # owed, ahead of the next decision

    async def background(self, fn: Callable[..., T], *args: object) -> T:
        """Run work that may call the store several times: inline on the memory store, on
        the worker thread on a shared one."""
        if self._worker is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def store_answers(self, now: float) -> bool:
        """Whether the shared store answers a read now (always, for the embedded one)."""
        if self.shared is None:
            return True
        return await self.background(self.core.store_answers, now)

    async def start(self) -> None:
        if self.shared is not None:
            await self.shared.warm()

    async def ends_done(self) -> None:
        """Wait for the lease ends (and recharges) in flight to reach the shared store: what a
        host that stops, or a test comparing decisions step by step, needs there."""
        if self._ending:
            await asyncio.gather(*self._ending, return_exceptions=True)

    async def aclose(self) -> None:
        """Wait for the lease ends in flight, then close the store's connections."""
        await self.ends_done()
        if self.shared is not None:
            await self.shared.aclose()
        if self._worker is not None:
            self._worker.shutdown(wait=True)


def open_driver(config: Config, now: float, replica: str, suspends: bool = False) -> StoreDriver:
    """The decision core on the store the config names, and the driver that runs it
    (`suspends`: the host suspends what the core takes back, control/core.py)."""
    settings = config.state
    if settings.backend == "memory":
        local = MemoryStore(counters_on_admit=True)  # every answer's x-ratelimit-* headers
        return StoreDriver(DecisionCore(config, local, now=now, replica=replica, suspends=suspends))
    # redis-py only where it is used
    from tokenpools.state.redis.hot_path import RedisHotPath
    from tokenpools.state.redis.store import RedisStore

    check_cluster_budgets(config)
    store = RedisStore(
        settings.url,
        timeout_s=settings.timeout_s,
        retry_interval_s=settings.retry_interval_s,
        prefix=settings.key_prefix,
        owner=replica,
        replica_timeout_s=settings.replica_timeout_s,
    )
    # The private store holds what the outage policy admits while Redis is unreachable.
    core = DecisionCore(
        config, store, now=now, replica=replica, fallback_store=MemoryStore(), suspends=suspends
    )
    return StoreDriver(core, RedisHotPath(store))


def check_cluster_budgets(config: Config) -> None:
    """On a Redis Cluster a budget's counter must share its pools' hash slot: a budget whose
    requests go to several pools is a config error there (docs/budgets.md)."""
    if config.state.backend != "redis" or "+cluster://" not in config.state.url:
        return
    spanning = Budgets(config).spanning()
    if spanning:
        raise ConfigError(
            f"budgets {', '.join(spanning)}: their requests go to several pools, whose keys a "
            "Redis Cluster keeps in different hash slots; give each pool its own budget, or use "
            "one Redis (or Sentinel)"
        )
