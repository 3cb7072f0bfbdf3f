"""Elastic work taken back after a capacity loss (control/eviction.py `overdrawn` and
`elastic_to_take_back`, control/periodic.py): where the host suspends, the elastic work that
now sits on the baselines of protected owners with work in flight is suspended, lowest priority
first and newest first, until the owners' baselines fit again, and never more; elastic work the
host cannot resume, and elastic work with no active owner to make room for, runs on. Checked on
generated pools, on the memory store and on Redis, against what the store's counters say."""

from __future__ import annotations

import random
import secrets
from typing import Any

import pytest

from tests.builders import make_config
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.control.store import Lease, Store
from tokenpools.model.request import RequestCost
from tokenpools.model.resources import Resources
from tokenpools.state.memory import MemoryStore

KV_PER_SLOT = 400  # each request reserves 100 prompt + 100 output tokens: half a slot's KV
TOKENS_PER_S = 100_000  # throughput never binds here


def generated_pool(rng: random.Random) -> tuple[list[dict[str, Any]], int, float]:
    """Protected owners whose baselines fit the capacity left after the loss, elastic tenants
    of different SLOs (so different priorities), and a spot tenant; the pool's slots and the
    share of them left after the loss."""
    slots = rng.choice([12, 16, 24])
    left = rng.uniform(0.35, 0.8)
    room = int(slots * left)
    ents: list[dict[str, Any]] = []
    for i in range(rng.randint(1, 2)):
        base = rng.randint(1, max(1, room // 2))
        ents.append(
            {"name": f"own{i}", "serviceClass": rng.choice(["guaranteed", "dedicated"]),
             "sloTargetMs": 1000, "concurrency": base, "kvTokens": base * KV_PER_SLOT}
        )  # fmt: skip
    for i in range(rng.randint(1, 3)):
        ents.append(
            {"name": f"el{i}", "serviceClass": "elastic",
             "sloTargetMs": rng.choice([500, 3000, 30000]), "concurrency": rng.randint(1, 4)}
        )  # fmt: skip
    ents.append({"name": "spot", "serviceClass": "spot"})
    return ents, slots, left


def fill(core: DecisionCore, ents: list[dict[str, Any]], rng: random.Random) -> dict[str, bool]:
    """Owners some of their baselines (some none), elastic work in random order (some of it
    not resumable), spot work on what is left; which leases the host can resume."""
    resumable: dict[str, bool] = {}
    t = 0.0
    asks = [
        e["name"]
        for e in ents
        if e["name"].startswith("own")
        for _ in range(rng.randint(0, e["concurrency"]))
    ]
    asks += [
        e["name"] for e in ents if e["name"].startswith("el") for _ in range(rng.randint(0, 8))
    ]
    rng.shuffle(asks)
    asks += ["spot"] * 30
    for i, name in enumerate(asks):
        t += 0.01
        can = rng.random() < 0.75
        d = core.admit(name, RequestCost(100, 100, resumable=can), t, f"{name}-{i}")
        if isinstance(d, Admit):
            resumable[d.lease.lease_id] = can
    return resumable


def in_flight(store: Store, name: str, now: float) -> float:
    return store.entitlement_counters(name, now).concurrency


def check_drain(seed: int, store: Store) -> int:
    rng = random.Random(seed)
    ents, slots, left = generated_pool(rng)
    config = make_config(
        ents, concurrency=slots, kv_tokens=slots * KV_PER_SLOT, tokens_per_s=TOKENS_PER_S,
        policy={"backfillWindowS": 0},
    )  # fmt: skip
    core = DecisionCore(config, store, now=0.0, suspends=True)
    resumable = fill(core, ents, rng)
    now = 1.0
    owners = [e for e in ents if e["name"].startswith("own")]
    elastic = [e["name"] for e in ents if e["name"].startswith("el")]
    before = {e["name"]: in_flight(store, e["name"], now) for e in ents}
    priority = {name: core.scores(name, now).priority for name in elastic}
    leases = {lid: store.get_lease(lid, now) for lid in resumable}
    flights = {lid: lease for lid, lease in leases.items() if lease is not None}
    new = Resources(TOKENS_PER_S, slots * left * KV_PER_SLOT, float(int(slots * left)))
    change = core.set_capacity("p", now, per_replica=new)
    taken = [lease for lease in change.evict if lease.entitlement != "spot"]

    # only elastic work its host can resume
    assert all(lease.entitlement in elastic and resumable[lease.lease_id] for lease in taken)
    active = [e for e in owners if before[e["name"]] > 0]
    counters = store.pool_counters("p", now)
    nonlent = counters.concurrency - counters.preemptible_concurrency
    held = sum(max(0.0, e["concurrency"] - before[e["name"]]) for e in active)
    if not active:
        assert not taken  # nobody to make room for
        return 0
    # enough: the active owners' baselines fit, or no resumable elastic work is left
    left_resumable = [
        lid for lid, lease in flights.items()
        if lease.entitlement in elastic and resumable[lid]
        and store.get_lease(lid, now) is not None
    ]  # fmt: skip
    over_kv = (
        counters.kv_tokens
        - counters.preemptible_kv
        + sum(
            max(0.0, e["kvTokens"] - store.entitlement_counters(e["name"], now).kv_tokens)
            for e in active
        )
        - new.kv_tokens
    )
    fits = nonlent + held <= new.concurrency and over_kv <= 0
    assert fits or not left_resumable
    # never more than needed: without the last one taken it would not have fitted
    if taken:
        last = taken[-1]
        assert nonlent + 1 + held > new.concurrency or over_kv + last.kv_tokens > 0
    # lowest priority first, each one's newest first
    for lease in taken:
        for lid in left_resumable:
            other = flights[lid]
            if other.entitlement == lease.entitlement:
                assert other.started_at <= lease.started_at
            else:
                assert priority[other.entitlement] >= priority[lease.entitlement]
    # then the owners' next requests within their baselines are admitted
    if fits:
        for e in active:
            room = e["concurrency"] - in_flight(store, e["name"], now)
            for i in range(int(room)):
                d = core.admit(e["name"], RequestCost(100, 100), now, f"{e['name']}-after-{i}")
                assert isinstance(d, Admit), d
    return len(taken)


def test_generated_pools_on_the_memory_store() -> None:
    taken = [check_drain(seed, MemoryStore()) for seed in range(60)]
    assert sum(n > 0 for n in taken) >= 10  # the case happened, often


def test_generated_pools_on_redis(redis_url: str) -> None:
    from tokenpools.state.redis.store import RedisStore

    taken = [
        check_drain(seed, RedisStore(redis_url, prefix=secrets.token_hex(4), timeout_s=2.0))
        for seed in range(0, 60, 4)
    ]
    assert sum(n > 0 for n in taken) >= 3  # the case happened


OWNER_AND_ELASTIC = [
    {"name": "gold", "serviceClass": "guaranteed", "sloTargetMs": 1000, "concurrency": 4},
    {"name": "team", "serviceClass": "elastic", "sloTargetMs": 3000, "concurrency": 4},
]


def drop(suspends: bool, gold: int, resumable: bool = True) -> tuple[DecisionCore, list[Lease]]:
    """8 slots: gold runs `gold` requests, team 4; then the pool keeps 4 slots."""
    config = make_config(OWNER_AND_ELASTIC, concurrency=8, tokens_per_s=TOKENS_PER_S)
    core = DecisionCore(config, MemoryStore(), now=0.0, suspends=suspends)
    for i in range(gold):
        assert isinstance(core.admit("gold", RequestCost(100, 100), 0.1, f"gold-{i}"), Admit)
    for i in range(4):
        d = core.admit("team", RequestCost(100, 100, resumable=resumable), 0.2 + i, f"team-{i}")
        assert isinstance(d, Admit)
    change = core.set_capacity("p", 5.0, per_replica=Resources(TOKENS_PER_S, 32768, 4))
    return core, list(change.evict)


def test_team_work_on_golds_baseline_is_taken_back_newest_first() -> None:
    core, taken = drop(suspends=True, gold=2)
    # 2 gold + 4 team + gold's 2 unused = 8 on 4 slots: 4 over, all team's
    assert [lease.lease_id for lease in taken] == ["team-3", "team-2", "team-1", "team-0"]
    # what surplus work learns from its evictions (control/backfill.py) is not touched
    assert core.pools["p"].claim_scale == 1.0
    assert all(isinstance(core.admit("gold", RequestCost(100, 100), 5.0), Admit) for _ in range(2))


@pytest.mark.parametrize(
    ("suspends", "gold", "resumable"),
    [(False, 2, True), (True, 0, True), (True, 2, False)],
    ids=["host-does-not-suspend", "owner-idle", "cannot-resume"],
)
def test_otherwise_elastic_work_runs_to_its_end(suspends: bool, gold: int, resumable: bool) -> None:
    _, taken = drop(suspends, gold, resumable)
    assert taken == []


def test_leases_started_together_are_taken_back_in_the_same_order_on_both_stores(
    redis_url: str,
) -> None:
    """Newest first means by start, then by id, on every store: team-9 and team-10 started
    at the same instant."""
    from tokenpools.state.redis.store import RedisStore

    def taken(store: Store) -> list[str]:
        config = make_config(OWNER_AND_ELASTIC, concurrency=8, tokens_per_s=TOKENS_PER_S)
        core = DecisionCore(config, store, now=0.0, suspends=True)
        assert isinstance(core.admit("gold", RequestCost(100, 100), 0.1, "gold-0"), Admit)
        for name in ("team-9", "team-10"):
            assert isinstance(core.admit("team", RequestCost(100, 100), 0.2, name), Admit)
        change = core.set_capacity("p", 1.0, per_replica=Resources(TOKENS_PER_S, 32768, 5))
        return [lease.lease_id for lease in change.evict]

    memory = taken(MemoryStore())
    assert memory == ["team-9"]  # ids compare as text: "team-9" > "team-10"
    assert taken(RedisStore(redis_url, prefix=secrets.token_hex(4), timeout_s=2.0)) == memory
