"""The Redis store against a real redis-server: the same decisions as the memory store, one
pool per replica group, leases that outlive their replica only by their TTL, and the policy
for an unreachable Redis."""

from __future__ import annotations

import math
import os
import random
import signal
import time
from collections import Counter
from dataclasses import fields
from typing import Any

import pytest
from redis.crc import key_slot

from tests.builders import make_config
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Reason, Reject
from tokenpools.control.store import StoreUnavailable
from tokenpools.model.config import Config
from tokenpools.model.request import RequestCost, Usage
from tokenpools.processes import free_port, redis_server
from tokenpools.state.memory import MemoryStore
from tokenpools.state.redis.store import RedisStore

ENTS: list[dict[str, Any]] = [
    {"name": "gold-a", "serviceClass": "guaranteed", "sloTargetMs": 800, "concurrency": 2},
    {"name": "gold-b", "serviceClass": "guaranteed", "sloTargetMs": 2000, "concurrency": 2},
    {"name": "dedicated", "serviceClass": "dedicated", "sloTargetMs": 1000, "concurrency": 1},
    {"name": "elastic-a", "serviceClass": "elastic", "sloTargetMs": 500, "concurrency": 3},
    {
        "name": "elastic-b",
        "serviceClass": "elastic",
        "sloTargetMs": 20000,
        "concurrency": 3,
        "burst": {"concurrency": 6},
    },
    {"name": "spot", "serviceClass": "spot"},
    {"name": "batch", "serviceClass": "preemptible"},
]
NAMES = [e["name"] for e in ENTS]


def config(
    overcommit: float = 0.1, ttl: float = 60, tokens_per_s: float = 240, claims: bool = True
) -> Config:
    return make_config(
        ENTS,
        concurrency=8,
        tokens_per_s=tokens_per_s,
        kv_tokens=4096,
        policy={
            "overcommit": overcommit,
            "leaseTtlS": ttl,
            "burstWindowS": 10,
            "elasticOversubscription": 2.0,
            **({} if claims else {"backfillWindowS": 0}),
        },
    )


def redis_core(url: str, cfg: Config, replica: str = "r0", **kw: Any) -> DecisionCore:
    return DecisionCore(
        cfg,
        store=RedisStore(url, timeout_s=1.0, **kw),
        replica=replica,
        fallback_store=MemoryStore(),
    )


def close(x: float, y: float) -> bool:
    return x == y or abs(x - y) <= 1e-9 * max(1.0, abs(x))


def assert_same_state(a: DecisionCore, b: DecisionCore, t: float, where: Any) -> None:
    pa, pb = a.store.pool_counters("p", t), b.store.pool_counters("p", t)
    for f in fields(pa):
        assert close(getattr(pa, f.name), getattr(pb, f.name)), (where, f.name, pa, pb)
    for name in NAMES:
        ea, eb = a.store.entitlement_counters(name, t), b.store.entitlement_counters(name, t)
        for f in fields(ea):
            assert close(getattr(ea, f.name), getattr(eb, f.name)), (where, name, f.name, ea, eb)
        assert a.store.scores(name, t) == b.store.scores(name, t), (where, name)


def test_the_same_random_events_give_the_same_decisions(redis_url: str, redis_client) -> None:
    """Differential: random arrivals, settles, releases, ticks (expiry, debt updates) and
    capacity changes through a memory-backed and a Redis-backed core in lockstep."""
    seen: Counter[str] = Counter()
    for seed in range(12):
        rng = random.Random(seed)
        redis_client.flushall()
        cfg = config(
            overcommit=rng.choice([0.0, 0.25]),
            ttl=rng.choice([5, 60]),
            tokens_per_s=rng.choice([40, 240]),
        )
        a, b = DecisionCore(cfg, MemoryStore()), redis_core(redis_url, cfg)
        t, live = 0.0, []
        for step in range(300):
            where = (seed, step)
            r = rng.random()
            if r < 0.55:
                t += rng.uniform(0, 0.4)
                name = rng.choice(NAMES)
                cost = RequestCost(rng.randint(0, 400), rng.randint(1, 200))
                da, db = a.admit(name, cost, t), b.admit(name, cost, t)
                if isinstance(da, Admit):
                    assert isinstance(db, Admit), (where, da, db)
                    assert da.lease.lease_id == db.lease.lease_id
                    assert [v.lease_id for v in da.evict] == [v.lease_id for v in db.evict]
                    assert da.overcommit == db.overcommit
                    live.append(da.lease.lease_id)
                    for v in da.evict:
                        live.remove(v.lease_id)
                    seen["evicting admit" if da.evict else "admit"] += 1
                    seen["overcommit"] += da.overcommit
                else:
                    assert isinstance(db, Reject), (where, da, db)
                    assert (da.reason, da.check, da.retry_after_s, da.quota) == (
                        db.reason,
                        db.check,
                        db.retry_after_s,
                        db.quota,
                    ), where
                    seen[da.reason.value] += 1
            elif r < 0.8 and live:
                t += rng.uniform(0, 1)
                lease_id = live.pop(rng.randrange(len(live)))
                usage = Usage(10, rng.randint(0, 300))
                assert (a.settle(lease_id, usage, t) is None) == (
                    b.settle(lease_id, usage, t) is None
                )
            elif r < 0.87 and live:
                lease_id = live.pop(rng.randrange(len(live)))
                refund = rng.random() < 0.5
                a.release(lease_id, t, refund=refund)
                b.release(lease_id, t, refund=refund)
            elif r < 0.93:  # capacity changes below: what sends a protected tenant overcommitting
                t += rng.uniform(0, 8)
                ra, rb = a.tick(t), b.tick(t)
                assert sorted(x.lease_id for x in ra.expired) == sorted(
                    x.lease_id for x in rb.expired
                ), where
                assert ra.updated_pools == rb.updated_pools
                for lease in ra.expired:
                    live.remove(lease.lease_id)
                seen["expired"] += len(ra.expired)
            else:
                replicas = rng.choice([1, 1, 2, 3, 0])
                ca, cb = a.set_replicas("p", replicas, t), b.set_replicas("p", replicas, t)
                assert [x.lease_id for x in ca.evict] == [x.lease_id for x in cb.evict]
                for lease in ca.evict:
                    live.remove(lease.lease_id)
            assert_same_state(a, b, t, where)
    # The sequences reached every branch that matters, or the comparison proves little.
    for what in ("admit", "evicting admit", "overcommit", "low_priority", "pool_full", "expired"):
        assert seen[what] > 0, (what, seen)


def test_one_period_update_per_pool_whatever_the_replicas(redis_url: str, redis_client) -> None:
    cfg = config()
    replicas = [redis_core(redis_url, cfg, replica=f"r{i}") for i in range(3)]
    for i, core in enumerate(replicas):
        assert core.admit(NAMES[i], RequestCost(100, 100), 1.0).admitted
    updates = [core.tick(6.0).updated_pools for core in replicas]
    assert sorted(updates) == [(), (), ("p",)]
    # The others read the new scores on their next tick.
    winner = replicas[[u != () for u in updates].index(True)]
    for core in replicas:
        core.tick(6.25)
        for name in NAMES:
            assert core.entitlements[name].priority == winner.entitlements[name].priority


def test_admission_is_shared_by_replicas(redis_url: str, redis_client) -> None:
    """Two cores on one Redis fill one pool: together they never exceed its slots."""
    cfg = config(overcommit=0.0, claims=False)
    a, b = redis_core(redis_url, cfg, "a"), redis_core(redis_url, cfg, "b")
    admitted = [core.admit("spot", RequestCost(10, 10), 1.0).admitted for core in (a, b) * 6]
    # 8 slots, 5 held back for the protected baselines (and, with claims off, nothing kept
    # for the elastic tenants): spot gets 3 across both replicas.
    assert sum(admitted) == 3
    assert a.store.pool_counters("p", 1.0).concurrency == 3


def test_a_dead_replicas_leases_come_back_within_the_ttl(redis_url: str, redis_client) -> None:
    cfg = config(ttl=5, claims=False)
    dead, alive = redis_core(redis_url, cfg, "dead"), redis_core(redis_url, cfg, "alive")
    held = [dead.admit("spot", RequestCost(10, 10), 0.0) for _ in range(3)]
    assert all(d.admitted for d in held)
    assert not alive.admit("spot", RequestCost(10, 10), 1.0).admitted  # the pool is full
    assert alive.tick(4.9).expired == ()
    expired = alive.tick(5.0).expired
    assert sorted(x.lease_id for x in expired) == sorted(d.lease.lease_id for d in held)
    counters = alive.store.pool_counters("p", 5.0)
    assert (counters.leases, counters.concurrency, counters.kv_tokens) == (0, 0.0, 0.0)
    assert alive.admit("spot", RequestCost(10, 10), 5.0).admitted


def test_a_renewed_lease_outlives_the_ttl_and_a_lost_one_says_so(
    redis_url: str, redis_client
) -> None:
    cfg = config(ttl=5, claims=False)
    a, b = redis_core(redis_url, cfg, "a"), redis_core(redis_url, cfg, "b")
    lease = a.admit("gold-a", RequestCost(10, 10), 0.0)
    assert isinstance(lease, Admit)
    assert a.renew(lease.lease.lease_id, 4.0)
    assert b.tick(8.0).expired == ()
    assert b.tick(9.0).expired[0].lease_id == lease.lease.lease_id
    assert not a.renew(lease.lease.lease_id, 9.5)


def test_redis_losing_its_data_books_each_held_lease_again_once(
    redis_url: str, redis_client
) -> None:
    cfg = config()
    a, b = redis_core(redis_url, cfg, "a"), redis_core(redis_url, cfg, "b")
    la = a.admit("gold-a", RequestCost(10, 10), 1.0)
    lb = b.admit("elastic-a", RequestCost(10, 10), 1.0)
    assert isinstance(la, Admit) and isinstance(lb, Admit)
    redis_client.flushall()  # what a restart without persistence does
    assert a.admit("gold-b", RequestCost(10, 10), 2.0).admitted  # a recreates the pool
    assert b.renew(lb.lease.lease_id, 2.0)  # b sees a new epoch: books its lease again
    counters = a.store.pool_counters("p", 2.0)
    assert (counters.leases, counters.concurrency) == (3, 3.0)
    for core, decision in ((a, la), (b, lb)):
        assert core.settle(decision.lease.lease_id, Usage(10, 5), 3.0) is not None
    counters = a.store.pool_counters("p", 3.0)
    assert (counters.leases, counters.concurrency) == (1, 1.0)
    for name in NAMES:
        e = a.store.entitlement_counters(name, 3.0)
        assert e.concurrency >= 0 and e.kv_tokens >= 0 and e.leases >= 0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_unreachable_redis_fails_closed_except_a_local_protected_budget(
    redis_client,
) -> None:
    """Redis is down from the start: spot and elastic are refused with store_unavailable,
    gold-a (concurrency 2, fallbackFraction 0.5) gets one local slot. When Redis comes up at
    the same address, the local lease is handed over once and settles there."""
    port = free_port()
    clock = Clock()
    cfg = config()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, clock=clock)
    core = DecisionCore(cfg, store=store, replica="r", fallback_store=MemoryStore())
    spot = core.admit("spot", RequestCost(10, 10), 1.0)
    assert isinstance(spot, Reject) and spot.reason == Reason.STORE_UNAVAILABLE
    assert spot.retry_after_s == cfg.state.retry_interval_s
    assert core.admit("elastic-a", RequestCost(10, 10), 1.0).reason == Reason.STORE_UNAVAILABLE
    gold = core.admit("gold-a", RequestCost(10, 10), 1.0)
    assert isinstance(gold, Admit)
    second = core.admit("gold-a", RequestCost(10, 10), 1.0)
    assert isinstance(second, Reject) and second.reason == Reason.CONCURRENCY_LIMIT
    assert "local budget" in second.message
    with redis_server(port):
        assert core.tick(1.5).expired == ()  # still within the retry interval: not tried
        assert core.fallback.leases
        clock.t += cfg.state.retry_interval_s
        core.tick(2.0)
        assert not core.fallback.leases
        counters = store.pool_counters("p", 2.0)
        assert (counters.leases, counters.concurrency) == (1, 1.0)
        core.tick(2.5)  # handing over twice would double count
        assert store.pool_counters("p", 2.5).leases == 1
        assert core.settle(gold.lease.lease_id, Usage(10, 10), 3.0) is not None
        counters = store.pool_counters("p", 3.0)
        assert (counters.leases, counters.concurrency, counters.kv_tokens) == (0, 0.0, 0.0)
        assert core.admit("spot", RequestCost(10, 10), 3.0).admitted


def test_a_stalled_redis_costs_two_timeouts_then_none_and_leaves_nothing_booked(
    redis_client,
) -> None:
    """SIGSTOP: one call that times out is a slow call (its request alone gets the outage
    policy); the second in a row makes Redis unreachable, and the next calls fail at once until
    the retry interval has passed. Ends of leases wait and are sent when Redis is back, and so
    are the ends of the admissions that timed out, which Redis booked when it woke."""
    with redis_server() as (url, proc):
        clock = Clock()
        cfg = config()
        store = RedisStore(url, timeout_s=0.5, clock=clock)
        core = DecisionCore(cfg, store=store, replica="r", fallback_store=MemoryStore())
        held = core.admit("elastic-a", RequestCost(10, 10), 1.0)
        assert isinstance(held, Admit)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            first = core.admit("spot", RequestCost(10, 10), 2.0)
            assert isinstance(first, Reject) and first.reason == Reason.STORE_UNAVAILABLE
            assert core.store.available  # one late reply is not an outage
            assert core.admit("gold-a", RequestCost(10, 10), 2.0).admitted  # local budget
            waited = time.monotonic() - start
            assert 0.9 <= waited < 1.0 + 0.5  # two timeouts
            assert not core.store.available
            start = time.monotonic()
            refused = core.admit("spot", RequestCost(10, 10), 2.0)
            assert isinstance(refused, Reject) and refused.reason == Reason.STORE_UNAVAILABLE
            assert core.settle(held.lease.lease_id, Usage(10, 10), 2.0) is not None
            assert time.monotonic() - start < 0.25  # not tried: a try would wait 0.5 s
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert store.owed == 3  # elastic-a's end; the spot and gold-a admissions given up
        clock.t += cfg.state.retry_interval_s
        core.tick(3.0)
        assert store.owed == 0
        assert store.entitlement_counters("gold-a", 3.0).leases == 1  # handed over
        assert store.entitlement_counters("elastic-a", 3.0).leases == 0  # the end was sent
        # The spot admission that timed out reached Redis once it woke, or will be refused if
        # it comes later: either way nothing stays booked for it.
        assert store.entitlement_counters("spot", 3.0).leases == 0
        assert store.pool_counters("p", 3.0).leases == 1


def test_the_lua_script_is_loaded_again_after_script_flush(redis_url: str, redis_client) -> None:
    core = redis_core(redis_url, config(claims=False))
    assert core.admit("spot", RequestCost(10, 10), 1.0).admitted
    redis_client.script_flush()
    assert core.admit("spot", RequestCost(10, 10), 1.0).admitted
    assert core.store.pool_counters("p", 1.0).leases == 2


def test_every_key_of_a_pool_shares_one_hash_tag(redis_url: str, redis_client) -> None:
    core = redis_core(redis_url, config(claims=False), prefix="tp")
    assert core.admit("batch", RequestCost(10, 10), 1.0).admitted
    core.admit("spot", RequestCost(10, 10), 1.0)
    keys = [k.decode() for k in redis_client.keys("*")]
    assert len(keys) > 5
    assert all(k.startswith("tp:{p}") for k in keys), keys
    assert len({key_slot(k.encode()) for k in keys}) == 1  # one Redis Cluster slot


def test_no_counter_goes_negative_when_ends_arrive_twice(redis_url: str, redis_client) -> None:
    cfg = config()
    a, b = redis_core(redis_url, cfg, "a"), redis_core(redis_url, cfg, "b")
    d = a.admit("gold-a", RequestCost(10, 10), 1.0)
    assert isinstance(d, Admit)
    assert a.settle(d.lease.lease_id, Usage(10, 10), 2.0) is not None
    assert a.settle(d.lease.lease_id, Usage(10, 10), 2.0) is None
    assert b.release(d.lease.lease_id, 2.0) is None
    c = a.store.pool_counters("p", 2.0)
    assert (c.leases, c.concurrency, c.kv_tokens) == (0, 0.0, 0.0)
    assert not math.isnan(c.bucket)


def test_bad_redis_url_is_a_config_error() -> None:
    from tokenpools.model.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"state\.url"):
        parse_config({"pools": [], "state": {"backend": "redis", "url": "localhost:6379"}})
    with pytest.raises(ConfigError, match=r"state\.backend"):
        parse_config({"pools": [], "state": {"backend": "etcd"}})


def test_store_unavailable_is_raised_not_hidden(redis_client) -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.1)
    with pytest.raises(StoreUnavailable):
        store.pool_counters("p", 0.0)
    assert not store.available


def test_a_redis_that_refuses_writes_is_an_outage_not_a_crash(redis_url: str, redis_client) -> None:
    core = redis_core(redis_url, config(claims=False))
    assert core.admit("spot", RequestCost(10, 10), 1.0).admitted
    redis_client.config_set("maxmemory", "1")  # every write now fails with OOM
    try:
        refused = core.admit("spot", RequestCost(10, 10), 2.0)
        assert isinstance(refused, Reject) and refused.reason == Reason.STORE_UNAVAILABLE
        assert core.admit("gold-a", RequestCost(10, 10), 2.0).admitted  # its local budget
    finally:
        redis_client.config_set("maxmemory", "0")


def test_a_replica_that_stopped_ticking_has_its_leases_ended_by_the_others(
    redis_url: str, redis_client
) -> None:
    """A gateway killed or restarted (under a new name) does not leave its leases to their TTL:
    once it has not ticked for the replica timeout, the next tick of any replica ends them,
    charged in full as expiry charges them; a replica that ticks keeps its own."""
    cfg = config(ttl=600)
    gone = redis_core(redis_url, cfg, "gone", owner="gone", replica_timeout_s=10)
    live = redis_core(redis_url, cfg, "live", owner="live", replica_timeout_s=10)
    theirs = [gone.admit("elastic-b", RequestCost(10, 10), 1.0) for _ in range(3)]
    ours = live.admit("gold-a", RequestCost(10, 10), 1.0)
    assert all(d.admitted for d in [*theirs, ours])
    gone.tick(1.0)  # its last heartbeat
    assert live.tick(10.5).expired == ()  # heard from 9.5 s ago: alive
    ended = live.tick(11.5).expired
    assert sorted(x.lease_id for x in ended) == sorted(d.lease.lease_id for d in theirs)
    counters = live.store.pool_counters("p", 11.5)
    assert (counters.leases, counters.concurrency) == (1, 1.0)  # ours stays
    assert not gone.renew(theirs[0].lease.lease_id, 12.0)  # its requests end if it wakes
    assert live.store.entitlement_counters("elastic-b", 11.5).leases == 0
    assert live.tick(30.0).expired == ()  # and the live one, ticking, is never taken for gone
    assert live.store.pool_counters("p", 30.0).leases == 1


def test_a_pool_written_before_reclaimable_tokens_counts_them_once(
    redis_url: str, redis_client
) -> None:
    """What taking back the lent work in flight would give back is kept on the pool record;
    a record written before it was kept is counted once from its lent leases, and the count
    ends at exactly 0 with the last of them, not below."""
    store = RedisStore(redis_url, timeout_s=1.0, prefix="up")
    core = DecisionCore(config(claims=False), store=store, suspends=True)
    admitted = [core.admit("batch", RequestCost(10, 10), 1.0, f"b{i}") for i in range(2)]
    assert all(isinstance(d, Admit) and d.lease.resumable for d in admitted)
    assert redis_client.hdel("up:{p}", "recl") == 1  # as the script before it left the pool
    held = sum(d.lease.tokens for d in admitted if isinstance(d, Admit))
    assert store.pool_counters("p", 1.0).reclaimable_tokens == pytest.approx(held)
    for d in admitted:
        assert isinstance(d, Admit)
        core.settle(d.lease.lease_id, Usage(10, 10), 2.0)
    assert store.pool_counters("p", 2.0).reclaimable_tokens == 0.0
