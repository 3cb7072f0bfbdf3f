"""The Redis store behind Sentinel (a master, a replica and three sentinels on loopback): three
gateway replicas enforce one pool through `redis+sentinel://`, and killing the master under
load promotes the replica, which the gateways follow; the outage policy holds meanwhile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import test_replicas as single
from tests.redis_topologies import RedisSentinel, redis_sentinel
from tokenpools.state.redis.connect import sync_client


@pytest.fixture
def watched() -> Iterator[RedisSentinel]:
    with redis_sentinel(replicas=1, sentinels=3, down_after_ms=1000) as topology:
        yield topology


@pytest.fixture
def replicas(watched: RedisSentinel, tmp_path: Path) -> Iterator[single.Cluster]:
    client = sync_client(watched.url, 1.0)  # follows the master, for the test's own reads
    with single.on_a_topology(tmp_path, watched.url, client) as gateways:
        yield gateways


def test_three_replicas_behind_sentinel_enforce_one_pool(replicas: single.Cluster) -> None:
    single.test_three_replicas_enforce_one_pool(replicas)


def test_killing_the_master_promotes_the_replica_and_the_gateways_follow(
    watched: RedisSentinel, replicas: single.Cluster
) -> None:
    master = watched.master()
    killed_at = single.kill_under_load(replicas, 10.0, watched.procs[master].kill)
    promoted = watched.master()
    late = single.assert_the_outage_policy_held(replicas, killed_at)
    assert promoted != master, "the sentinels promoted the replica"
    replies = replicas.replies
    print(
        f"master {master} killed; {promoted} promoted; "
        f"{sum(r.status == 503 for r in replies)} refused while it was away, "
        f"{sum(r.status == 200 for r in late)} admitted in the last 2 s"
    )
