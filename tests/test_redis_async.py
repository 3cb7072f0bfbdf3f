"""The gateway's awaited path to Redis (StoreDriver over RedisHotPath): lease ends that
come together go to Redis together, and leave the ledger as ending them one by one in memory
does."""

from __future__ import annotations

import asyncio

import redis

from tests.builders import make_config
from tokenpools.admission.driver import StoreDriver
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Reject
from tokenpools.model.request import RequestCost, Usage
from tokenpools.state.memory import MemoryStore
from tokenpools.state.redis.hot_path import RedisHotPath
from tokenpools.state.redis.store import RedisStore


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def test_lease_ends_that_come_together_go_in_one_call_and_settle_as_one_by_one(
    redis_url: str, redis_client: redis.Redis
) -> None:
    config = make_config(
        [
            {"name": "a", "serviceClass": "elastic", "concurrency": 40, "sloTargetMs": 1000},
            {"name": "b", "serviceClass": "spot"},
        ],
        concurrency=64,
        tokens_per_s=100000,
        policy={"backfillWindowS": 0},  # nothing claimed for elastic a: spot fills the pool
    )
    memory = DecisionCore(config, MemoryStore(), now=0.0)
    shared = DecisionCore(config, RedisStore(redis_url, timeout_s=1.0), now=0.0)
    costs = [RequestCost(100 + i, 20 + i) for i in range(24)]
    usages = [Usage(100 + i, 5 + 2 * i) for i in range(24)]

    async def go() -> int:
        ledger = StoreDriver(shared, RedisHotPath(shared.store))  # type: ignore[arg-type]
        await ledger.start()
        leases = []
        for i, cost in enumerate(costs):
            decision = await ledger.admit("ab"[i % 2], cost, 1.0 + i / 100)
            assert isinstance(decision, Admit)
            leases.append(decision.lease)
        before = script_calls(redis_client)
        for lease, usage in zip(leases, usages, strict=True):
            ledger.end(lease, usage, 2.0)  # each its own task, all in one loop turn
        await ledger.aclose()
        return script_calls(redis_client) - before

    calls = asyncio.run(go())
    admitted = [memory.admit("ab"[i % 2], cost, 1.0 + i / 100) for i, cost in enumerate(costs)]
    for decision, usage in zip(admitted, usages, strict=True):
        assert isinstance(decision, Admit)
        memory.settle(decision.lease.lease_id, usage, 2.0)
    # Ended in one loop turn: all 24 are queued before the call that sends them starts.
    assert calls == 1
    assert shared.store.pool_counters("p", 2.0) == memory.store.pool_counters("p", 2.0)
    for name in "ab":
        assert shared.store.entitlement_counters(name, 2.0) == memory.store.entitlement_counters(
            name, 2.0
        )
    assert shared.store.pool_counters("p", 2.0).leases == 0


def test_admissions_that_come_together_go_in_one_call_and_decide_as_one_by_one(
    redis_url: str, redis_client: redis.Redis
) -> None:
    config = make_config(
        [
            {"name": "a", "serviceClass": "guaranteed", "concurrency": 2, "sloTargetMs": 1000},
            {"name": "b", "serviceClass": "spot"},
            {"name": "c", "serviceClass": "preemptible"},
        ],
        concurrency=6,
    )
    # r3 twice: a request id already holding a lease is the caller's error, for it alone
    arrivals = [(f"r{i}", "abc"[i % 3], RequestCost(50 + i, 10 + i)) for i in range(14)]
    arrivals.insert(7, ("r3", "b", RequestCost(10, 10)))
    memory = DecisionCore(config, MemoryStore(), now=0.0)
    expected: list[object] = []
    for request_id, name, cost in arrivals:
        try:
            expected.append(memory.admit(name, cost, 1.0, request_id))
        except ValueError:
            expected.append(ValueError)

    shared = DecisionCore(config, RedisStore(redis_url, timeout_s=1.0), now=0.0)

    async def go() -> tuple[list[object], int]:
        ledger = RedisHotPath(shared.store)  # type: ignore[arg-type]
        await ledger.warm()
        steps = [shared.prepare(name, cost, 1.0, rid) for rid, name, cost in arrivals]
        before = script_calls(redis_client)
        outcomes = await asyncio.gather(
            *(ledger.admit(step, 1.0) for step in steps), return_exceptions=True
        )
        calls = script_calls(redis_client) - before
        decided: list[object] = []
        for step, outcome in zip(steps, outcomes, strict=True):
            if isinstance(outcome, ValueError):
                decided.append(ValueError)
            else:
                decided.append(shared.decide(step, outcome, 1.0))  # type: ignore[arg-type]
        await ledger.aclose()
        return decided, calls

    decided, calls = asyncio.run(go())
    assert calls == 1, "all fifteen in one script call"
    assert [verdict(d) for d in decided] == [verdict(e) for e in expected]
    assert {"admitted", "duplicate"} < {verdict(e) for e in expected}, "and refusals"
    assert shared.store.pool_counters("p", 1.0) == memory.store.pool_counters("p", 1.0)


def verdict(decision: object) -> str:
    if decision is ValueError:
        return "duplicate"
    if isinstance(decision, Admit):
        return "admitted"
    return str(decision.reason.value)  # type: ignore[attr-defined]


def test_an_admission_whose_caller_is_cancelled_on_the_way_leaves_no_lease(
    redis_url: str,
) -> None:
    config = make_config([{"name": "b", "serviceClass": "spot"}])
    core = DecisionCore(config, RedisStore(redis_url, timeout_s=1.0, prefix="orphan"), now=0.0)

    async def go() -> tuple[int, bool]:
        ledger = RedisHotPath(core.store)  # type: ignore[arg-type]
        await ledger.warm()
        step = core.prepare("b", RequestCost(10, 10), 1.0)
        caller = asyncio.ensure_future(ledger.admit(step, 1.0))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # queued, and its call on the way
        caller.cancel()  # a client that disconnected
        await asyncio.gather(caller, return_exceptions=True)
        await ledger.aclose()  # waits for the reply, and sends the end of what was given up
        return core.store.pool_counters("p", 1.0).leases, caller.cancelled()

    leases, cancelled = asyncio.run(go())
    assert cancelled
    assert leases == 0


def test_a_lease_that_ends_while_it_is_handed_over_leaves_nothing_booked(redis_url: str) -> None:
    """A lease admitted on the local budget is handed over to Redis on the event loop; its
    request ends while the booking is on its way. The end is owed to Redis and sent ahead of
    the next call: nothing stays booked, and the local budget is free."""
    config = make_config(
        [{"name": "gold", "serviceClass": "guaranteed", "concurrency": 2, "sloTargetMs": 1000}]
    )
    store = RedisStore(redis_url, timeout_s=1.0, prefix="handover")
    core = DecisionCore(config, store, now=0.0, fallback_store=MemoryStore())

    async def go() -> tuple[int, float, int]:
        ledger = StoreDriver(core, RedisHotPath(store))
        await ledger.start()
        step = core.prepare("gold", RequestCost(10, 10), 1.0)
        assert not isinstance(step, Reject)
        local = core.decide(step, None, 1.0)  # decided as while Redis was away
        assert isinstance(local, Admit) and local.lease.lease_id in core.fallback.leases
        handing = asyncio.ensure_future(ledger.hand_over(1.5))
        await asyncio.sleep(0)  # one loop turn: the booking is written, its reply awaited
        booked_meanwhile = core.store.owed
        ledger.end(local.lease, Usage(10, 5), 1.6)  # the request ends meanwhile
        await handing
        await ledger.send_unsent()
        counters = store.pool_counters("p", 2.0)
        await ledger.aclose()
        return counters.leases, counters.concurrency, booked_meanwhile

    leases, concurrency, owed_before = asyncio.run(go())
    assert owed_before == 0
    assert (leases, concurrency) == (0, 0.0)
    assert not core.fallback.leases
