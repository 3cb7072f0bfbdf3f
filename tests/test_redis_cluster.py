"""The Redis store on a real Redis Cluster (three masters, a replica each, on loopback): pools
spread over the shards and decide as the memory store does; three gateway replicas enforce one
pool; killing the master that holds a pool promotes its replica under load, and the outage
policy holds meanwhile."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.cluster

from tests import test_replicas as single
from tests.redis_topologies import RedisCluster, redis_cluster
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.model.config import parse_config
from tokenpools.model.request import RequestCost, Usage
from tokenpools.state.memory import MemoryStore
from tokenpools.state.redis.store import RedisStore


@pytest.fixture(scope="module")
def shards() -> Iterator[RedisCluster]:
    with redis_cluster(masters=3, replicas=1, node_timeout_ms=2000) as c:
        yield c


def client(c: RedisCluster) -> Any:
    nodes = [redis.cluster.ClusterNode("127.0.0.1", p) for p in c.ports]
    return redis.cluster.RedisCluster(startup_nodes=nodes, socket_timeout=1)


def spread_pools(c: RedisCluster, prefix: str) -> list[str]:
    """Pool names whose keys land on three different masters."""
    by_master: dict[int, str] = {}
    for i in range(200):
        by_master.setdefault(c.master_of(f"{prefix}:{{pool{i}}}"), f"pool{i}")
        if len(by_master) == 3:
            return sorted(by_master.values())
    raise AssertionError("three masters expected")


CLASSES = ("guaranteed", "spot", "preemptible")


def entitlement(pool: str, cls: str) -> dict[str, Any]:
    ent: dict[str, Any] = {"name": f"{pool}-{cls}", "tenantId": pool, "pool": pool}
    ent["serviceClass"] = cls
    if cls == "guaranteed":
        ent.update(concurrency=2, sloTargetMs=1000)
    return ent


def test_pools_spread_over_shards_and_decide_as_in_memory(shards: RedisCluster) -> None:
    pools = spread_pools(shards, "diff")
    per_replica = {"tokensPerSecond": 240, "kvTokens": 4096, "concurrency": 4}
    config = parse_config(
        {
            "pools": [
                {"name": p, "model": "Llama-3.1-8B", "perReplica": per_replica} for p in pools
            ],
            "entitlements": [entitlement(p, cls) for p in pools for cls in CLASSES],
            # every idle baseline lent, so that guaranteed requests evict preemptible work
            # here; the lending limits are compared in tests/test_store_differential.py
            "policy": {"backfillWindowS": 0},
        }
    )
    store = RedisStore(shards.url, timeout_s=1.0, prefix="diff")
    a, b = DecisionCore(config, MemoryStore()), DecisionCore(config, store)
    rng = random.Random(7)
    names, live, t = list(config.entitlements), [], 0.0
    outcomes: set[str] = set()
    for step in range(400):
        t += rng.uniform(0, 0.3)
        if live and rng.random() < 0.4:
            lease_id = live.pop(rng.randrange(len(live)))
            usage = Usage(10, rng.randint(0, 100))
            assert (a.settle(lease_id, usage, t) is None) == (b.settle(lease_id, usage, t) is None)
            continue
        name, cost = rng.choice(names), RequestCost(rng.randint(0, 200), rng.randint(1, 100))
        da, db = a.admit(name, cost, t), b.admit(name, cost, t)
        assert type(da) is type(db), (step, da, db)
        if isinstance(da, Admit):
            assert isinstance(db, Admit)
            assert [v.lease_id for v in da.evict] == [v.lease_id for v in db.evict]
            live.append(da.lease.lease_id)
            live = [x for x in live if x not in {v.lease_id for v in da.evict}]
            outcomes.add("evicting" if da.evict else "admitted")
        else:
            assert (da.reason, da.retry_after_s) == (db.reason, db.retry_after_s)  # type: ignore[union-attr]
            outcomes.add(da.reason.value)
        if step % 50 == 0:
            a.tick(t), b.tick(t)
    for pool in pools:
        assert a.store.pool_counters(pool, t) == b.store.pool_counters(pool, t)
    assert {"admitted", "evicting", "pool_full"} <= outcomes, outcomes
    assert len({shards.master_of(f"diff:{{{p}}}") for p in pools}) == 3


@pytest.fixture
def replicas(shards: RedisCluster, tmp_path: Path) -> Iterator[single.Cluster]:
    c = client(shards)
    for key in c.scan_iter("tokenpools:*"):
        c.delete(key)
    with single.on_a_topology(tmp_path, shards.url, c) as gateways:
        yield gateways


def test_three_replicas_on_the_cluster_enforce_one_pool(replicas: single.Cluster) -> None:
    single.test_three_replicas_enforce_one_pool(replicas)


def test_killing_the_pools_master_promotes_its_replica_under_load(
    shards: RedisCluster, replicas: single.Cluster
) -> None:
    master = shards.master_of("tokenpools:{p}")
    killed_at = single.kill_under_load(replicas, 9.0, shards.procs[master].kill)
    shards.wait_ok()
    promoted = shards.master_of("tokenpools:{p}")
    late = single.assert_the_outage_policy_held(replicas, killed_at)
    assert promoted != master, "a replica took over the pool's slots"
    replies = replicas.replies
    print(
        f"master {master} killed; {promoted} serves the pool; "
        f"{sum(r.status == 503 for r in replies)} refused while it was away, "
        f"{sum(r.status == 200 for r in late)} admitted in the last 2 s"
    )
