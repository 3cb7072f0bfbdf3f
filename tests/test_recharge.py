"""A suspended request's segment is charged what its client received (Store.recharge): the
store ends a taken-back lease on its whole reservation (it cannot know what the segment
produced), and the host, once it knows, charges that instead. Generated pools (weights,
prices), budgets of every measure, and interleaved spot admissions, owners taking room back,
settlements and recharges, on the memory store and on Redis alike: the ledger holds exactly
what the clients received, a budget never counts more than it did before a recharge, and never
stands above its limit."""

from __future__ import annotations

import random
import secrets
from typing import Any

import pytest

from tests.builders import store_named
from tokenpools.admission import Admitted
from tokenpools.control.budgets import budget_status, used
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.control.metering import Charge, budget_refund, counted
from tokenpools.control.store import Lease, Store
from tokenpools.model.config import Config, parse_config
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.state.memory import MemoryStore

START = 1_800_000_000.0
MEASURES = ("input", "output", "tokens", "cost")
ENTITLEMENTS = [
    {"name": "gold", "tenantId": "g", "pool": "p", "serviceClass": "guaranteed",
     "sloTargetMs": 1000, "concurrency": 4},
    {"name": "spot", "tenantId": "acme", "pool": "p", "serviceClass": "spot"},
]  # fmt: skip


def lending_core(config: Config, store: Store) -> DecisionCore:
    """A core whose owners were measured by START (its first update period is over): from
    then on it claims nothing for them, and spot work is lent their idle baselines."""
    core = DecisionCore(config, store, now=START - config.policy.update_period_s - 0.1,
                        suspends=True)  # fmt: skip
    core.tick(START)
    return core


def generated_config(rng: random.Random) -> Config:
    measure = rng.choice(MEASURES)
    limit: Any = rng.choice([3000, 20000]) if measure != "cost" else rng.choice(["0.01", "0.1"])
    pool = {
        "name": "p", "model": "Qwen3-8B", "schedulingPolicy": "priority",
        "tokenWeights": {"input": rng.choice([0.5, 1, 2]), "output": rng.choice([1, 2, 4])},
        "prices": {"inputPerMillion": rng.choice(["0.15", "1", "3"]),
                   "outputPerMillion": rng.choice(["0.6", "4", "15"])},
        "perReplica": {"tokensPerSecond": 1e9, "kvTokens": 10**7, "concurrency": 8},
    }  # fmt: skip
    return parse_config(
        {
            "policy": {"backfillWindowS": 40},
            "pools": [pool],
            "entitlements": ENTITLEMENTS,
            "budgets": [{"name": "b", "tenant": "acme", "limit": limit, "measure": measure}],
        }
    )


def run(core: DecisionCore, rng: random.Random) -> tuple[Charge, int]:
    """Spot fills the pool, gold takes room back; each taken-back spot lease is charged what
    its client received (some never are: their whole reservation stays charged). Returns the
    spot tenant's received total and how many leases were recharged."""
    pool = core.config.pools["p"]
    acme, gold_account = Account("acme", "k", "m"), Account("g", "k", "m")
    spot: dict[str, tuple[Lease, int]] = {}
    gold: list[Lease] = []
    received = Charge()
    recharged = 0
    now = START

    def add(charge: Charge) -> None:
        nonlocal received
        received = Charge(
            *(getattr(received, m) + getattr(charge, m) for m in Charge.__dataclass_fields__)
        )

    def within(lease: Lease, prompt: int) -> Usage:
        worst = lease.meter.worst  # type: ignore[union-attr]
        return Usage(rng.choice([0, prompt]), rng.randint(0, int(worst.output)))

    for step in range(250):
        now += 0.1
        roll = rng.random()
        if roll < 0.45:
            prompt = rng.randint(1, 300)
            d = core.admit("spot", RequestCost(prompt, rng.randint(1, 200), 1, acme), now)
            if isinstance(d, Admit):
                spot[d.lease.lease_id] = (d.lease, prompt)
        elif roll < 0.65 and len(gold) < 4:
            d = core.admit("gold", RequestCost(50, 50, 1, gold_account), now)
            if isinstance(d, Admit):
                gold.append(d.lease)
                for victim in d.evict:
                    lease, prompt = spot.pop(victim.lease_id)
                    if rng.random() < 0.8:  # the host knows what the segment produced
                        usage = within(lease, prompt)
                        (before,) = budget_status(core, now)
                        core.recharge(lease, usage, now)
                        (after,) = budget_status(core, now)
                        worst = lease.meter.worst  # type: ignore[union-attr]
                        back = budget_refund(used(pool, usage), worst, before["measure"])
                        assert after["used"] == pytest.approx(before["used"] - back)
                        add(used(pool, usage))
                        recharged += 1
                    else:  # it never says: the whole reservation stays charged
                        add(lease.meter.worst)  # type: ignore[union-attr]
        elif roll < 0.85 and spot:
            lease, prompt = spot.pop(rng.choice(list(spot)))
            usage = within(lease, prompt)
            core.settle(lease.lease_id, usage, now)
            add(used(pool, usage))
        elif gold:
            core.settle(gold.pop(0).lease_id, Usage(50, 10), now)
        (status,) = budget_status(core, now)
        assert status["used"] + status["held"] <= status["limit"] + 1e-6, (step, status)
    for lease, prompt in spot.values():
        usage = within(lease, prompt)
        core.settle(lease.lease_id, usage, now)
        add(used(pool, usage))
    for lease in gold:
        core.settle(lease.lease_id, Usage(50, 10), now)
    return received, recharged


def spot_ledger(store: Store) -> dict[str, float]:
    totals: dict[str, float] = {}
    for row in store.pending_usage("p", START + 10**5, 10**6).rows:
        if "\x1fspot\x1f" in row.bucket:
            for k, v in row.values.items():
                totals[k] = totals.get(k, 0.0) + v
    return totals


def check(core: DecisionCore, received: Charge) -> None:
    totals = spot_ledger(core.store)
    for measure in ("input", "output", "tokens", "cost"):
        assert totals.get(measure, 0.0) == pytest.approx(getattr(received, measure), abs=1e-6)
    (status,) = budget_status(core, START + 100)
    assert status["held"] == pytest.approx(0.0, abs=1e-6)  # nothing left held
    # no overrun here (usage within each reservation): the budget counts what was received
    assert status["used"] == pytest.approx(counted(received, received, status["measure"]))
    assert core.store.pool_counters("p", START + 100).leases == 0  # nothing left behind


def generated(seed: int, store: Store) -> None:
    rng = random.Random(seed)
    core = lending_core(generated_config(rng), store)
    received, recharged = run(core, rng)
    assert recharged > 0  # the case happened
    check(core, received)


@pytest.mark.parametrize("seed", range(12))
def test_the_ledger_and_budgets_count_what_the_clients_received(seed: int) -> None:
    generated(seed, MemoryStore())


@pytest.mark.parametrize("seed", range(4))
def test_on_redis_likewise(seed: int, redis_url: str) -> None:
    from tokenpools.state.redis.store import RedisStore

    generated(seed, RedisStore(redis_url, prefix=secrets.token_hex(4), timeout_s=2.0))


def test_a_recharge_never_takes_a_budget_up() -> None:
    """A charge above the worst case in some measure (an engine that counted more) gives
    nothing back in it, and takes nothing more."""
    rng = random.Random(7)
    core = lending_core(generated_config(rng), MemoryStore())
    acme = Account("acme", "k", "m")
    spot = [core.admit("spot", RequestCost(10, 10, 1, acme), START) for _ in range(8)]
    assert all(isinstance(d, Admit) for d in spot)
    d = core.admit("gold", RequestCost(50, 50, 1, Account("g", "k", "m")), START)
    assert isinstance(d, Admit) and len(d.evict) == 1
    (before,) = budget_status(core, START)
    core.recharge(d.evict[0], Usage(10_000, 10_000), START)
    (after,) = budget_status(core, START)
    assert after["used"] == before["used"]


def test_only_a_request_taken_back_is_recharged_and_only_once() -> None:
    """The guard between a recharge and a lease that was never charged its whole reservation:
    a request that ended on its own (settled or released) is not recharged; one taken back is,
    once."""
    calls: list[Usage] = []
    lease = Lease("l", "p", "spot", 100.0, 10.0, 0.0, 60.0, True)

    def admitted() -> Admitted:
        return Admitted(lease, None, lambda *_: None, lambda _, usage: calls.append(usage))

    settled = admitted()
    settled.end(Usage(10, 5))
    assert not settled.recharge(Usage(10, 5))
    running = admitted()
    assert not running.recharge(Usage(10, 5))  # not taken back
    taken = admitted()
    taken.evict()
    assert taken.recharge(Usage(10, 5)) and not taken.recharge(Usage(10, 6))
    assert calls == [Usage(10, 5)]


def test_a_recharge_after_its_pool_left_the_config_does_nothing() -> None:
    rng = random.Random(3)
    config = generated_config(rng)
    core = lending_core(config, MemoryStore())
    d = core.admit("spot", RequestCost(10, 10, 1, Account("acme", "k", "m")), START)
    assert isinstance(d, Admit)
    capacity = {"tokensPerSecond": 1000, "kvTokens": 10**6, "concurrency": 8}
    other = {"name": "q", "model": "Qwen3-8B", "perReplica": capacity}
    core.apply_config(
        parse_config({"pools": [other], "entitlements": [
            {"name": "x", "tenantId": "x", "pool": "q", "serviceClass": "spot"}]}),
        START + 1,
    )  # fmt: skip
    core.recharge(d.lease, Usage(5, 5), START + 1)  # the lease ended with its pool; no KeyError


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_window_given_room_back_is_no_longer_spent(
    store: str, request: pytest.FixtureRequest
) -> None:
    """A request that did not fit marks its budget window spent (exhausted); a recharge that
    gives room back clears it, on both stores."""
    data = {
        "pools": [{"name": "p", "model": "Qwen3-8B", "schedulingPolicy": "priority",
                   "perReplica": {"tokensPerSecond": 1e9, "kvTokens": 10**7, "concurrency": 8}}],
        "entitlements": ENTITLEMENTS,
        "budgets": [{"name": "b", "tenant": "acme", "limit": 800, "measure": "output"}],
    }  # fmt: skip
    core = lending_core(parse_config(data), store_named(store, request))
    acme = Account("acme", "k", "m")
    spot = [core.admit("spot", RequestCost(10, 100, 1, acme), START) for _ in range(8)]
    assert all(isinstance(d, Admit) for d in spot)  # 8 × 100 output: the whole budget
    assert not isinstance(core.admit("spot", RequestCost(10, 100, 1, acme), START), Admit)
    (spent,) = budget_status(core, START)
    assert spent["exhausted"]
    d = core.admit("gold", RequestCost(50, 50, 1, Account("g", "k", "m")), START)
    assert isinstance(d, Admit) and len(d.evict) == 1
    taken = next(
        s.lease for s in spot if isinstance(s, Admit) and s.lease.lease_id == d.evict[0].lease_id
    )
    core.recharge(taken, Usage(10, 20), START)
    (after,) = budget_status(core, START)
    assert not after["exhausted"] and after["used"] + after["held"] == 720
