"""A gateway that restarts (docs/decisions.md, "A restart"): on a store that kept what the
others measured (Redis, or the same memory store), the new process keeps the claims; on an
empty store it claims every baseline until measured; an entitlement that binds again within a
process's life claims its baseline again. Both stores, through the decision core."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from tests.builders import make_config
from tests.test_admission import BATCH, GUARANTEED, SMALL
from tokenpools.control.core import DecisionCore
from tokenpools.control.store import Store
from tokenpools.state.memory import MemoryStore
from tokenpools.state.redis.store import RedisStore

ASSIST = {"name": "assist", "serviceClass": "elastic", "sloTargetMs": 3000, "concurrency": 4}
ENTS = [GUARANTEED, ASSIST, BATCH]  # gold claims 6 slots, assist 4, of the pool's 16


@pytest.fixture(params=["memory", "redis"])
def new_store(request: pytest.FixtureRequest) -> Iterator[Callable[[], Store]]:
    """Each call: a store client; Redis's share one server's state (`wipe` empties it, as a
    Redis restarted without persistence), memory's share none."""
    if request.param == "memory":
        yield MemoryStore
        return
    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    client.flushall()
    url = request.getfixturevalue("redis_url")

    def connect(wipe: bool = False) -> Store:
        if wipe:
            client.flushall()
        return RedisStore(url, timeout_s=1.0)

    yield connect
    client.close()


def claimed(core: DecisionCore, t: float) -> float:
    return core.store.pool_counters("p", t).claimed_concurrency


def batch_admitted(core: DecisionCore, t: float) -> int:
    return sum(core.admit("batch", SMALL, t).admitted for _ in range(17))


def idle_for(core: DecisionCore, start: float, seconds: float) -> float:
    t = start
    while t < start + seconds:
        t += 5.0
        core.tick(t)
    return t


def test_a_restart_on_a_kept_store_keeps_the_claims_others_measured(
    new_store: Callable[[], Store],
) -> None:
    config = make_config(ENTS)
    store = new_store()
    first = DecisionCore(config, store, now=0.0)
    assert claimed(first, 0.0) == 10  # nothing measured: both baselines
    t = idle_for(first, 0.0, 200.0)  # the owners stay idle: their claims fade away
    assert claimed(first, t) < 0.1
    # The gateway restarts on the same store (a rolling update with Redis): the owners are
    # still idle, so surplus work may still fill the pool.
    kept = store if isinstance(store, MemoryStore) else new_store()
    second = DecisionCore(config, kept, now=t)
    assert claimed(second, t) < 0.1
    assert batch_admitted(second, t + 0.1) == 16


def test_a_restart_on_an_empty_store_claims_every_baseline_until_measured(
    new_store: Callable[[], Store],
) -> None:
    config = make_config(ENTS)
    first = DecisionCore(config, new_store(), now=0.0)
    t = idle_for(first, 0.0, 200.0)
    assert claimed(first, t) < 0.1
    empty = new_store() if isinstance(first.store, MemoryStore) else new_store(wipe=True)  # type: ignore[call-arg]
    second = DecisionCore(config, empty, now=t)
    assert claimed(second, t) == 10
    assert batch_admitted(second, t + 0.1) == 6  # what the baselines leave free


def test_an_entitlement_that_binds_again_claims_its_baseline_again(
    new_store: Callable[[], Store],
) -> None:
    config = make_config(ENTS, concurrency=2, replicas=8)
    core = DecisionCore(config, new_store(), now=0.0)
    t = idle_for(core, 0.0, 200.0)
    assert claimed(core, t) < 0.1
    # Eight replicas (16 slots) shrink to one: neither baseline fits any more.
    assert set(core.set_replicas("p", 1, t).states.values()) == {"Degraded"}
    assert set(core.set_replicas("p", 8, t + 1.0).states.values()) == {"Bound"}
    assert claimed(core, t + 1.0) == pytest.approx(10)  # both baselines again, until measured
