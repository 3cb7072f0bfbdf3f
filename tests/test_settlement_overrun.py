"""When the engine counts more than admission reserved (a prompt estimated short), a budget
counts the request at most its reservation, so it never ends above its limit, and the ledger
keeps what the engine counted with the excess recorded beside it (over_tokens, over_cost): no
served token goes unrecorded. Generated pools (weights, prices), budgets of every measure and
interleaved requests, on the memory store and on Redis alike."""

from __future__ import annotations

import random
import secrets
from typing import Any

import pytest

from tokenpools.control.budgets import budget_status, used, worst_case
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.control.store import Store
from tokenpools.model.config import Config, parse_config
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.state.memory import MemoryStore


def generated_config(rng: random.Random) -> Config:
    measure = rng.choice(["tokens", "input", "output", "cost"])
    limit: Any = (
        rng.choice([500, 2000, 9000]) if measure != "cost" else rng.choice(["0.001", "0.01"])
    )
    pool = {
        "name": "p", "model": "Qwen3-8B",
        "tokenWeights": {"input": rng.choice([0.5, 1, 2]), "output": rng.choice([1, 2, 4])},
        "prices": {"inputPerMillion": rng.choice(["0.15", "1", "3"]),
                   "outputPerMillion": rng.choice(["0.6", "4", "15"])},
        "perReplica": {"tokensPerSecond": 1e9, "kvTokens": 10**7, "concurrency": 64},
    }  # fmt: skip
    return parse_config(
        {
            "pools": [pool],
            "entitlements": [
                {"name": "a", "tenantId": "acme", "pool": "p", "serviceClass": "elastic"}
            ],
            "budgets": [{"name": "b", "tenant": "acme", "limit": limit, "measure": measure}],
        }
    )


def run(core: DecisionCore, rng: random.Random) -> dict[str, float]:
    """Interleaved requests whose engine counts 0.3×–4× the estimated prompt; returns what the
    engine counted and how much of it was over each request's reservation."""
    account = Account("acme", "k", "m")
    pool = core.config.pools["p"]
    held: list[tuple[Admit, int]] = []
    served = {"input": 0.0, "output": 0.0, "over_tokens": 0.0, "over_cost": 0.0}
    now = 1_800_000_000.0
    for _ in range(300):
        now += 0.1
        if held and (rng.random() < 0.5 or len(held) > 8):
            d, estimate = held.pop(rng.randrange(len(held)))
            worst = d.lease.meter.worst  # type: ignore[union-attr]
            usage = Usage(
                max(0, round(estimate * rng.choice([0.3, 1.0, 1.4, 2.0, 4.0]))),
                rng.randint(0, int(worst.output)),
            )
            core.settle(d.lease.lease_id, usage, now)
            charge = used(pool, usage)
            served["input"] += usage.input_tokens
            served["output"] += usage.output_tokens
            served["over_tokens"] += max(0.0, charge.tokens - worst.tokens)
            served["over_cost"] += max(0.0, charge.cost - worst.cost)
        else:
            estimate = rng.randint(1, 300)
            d = core.admit("a", RequestCost(estimate, rng.randint(0, 200), 1, account), now)
            if isinstance(d, Admit):
                assert d.lease.meter is not None
                assert d.lease.meter.worst == worst_case(
                    pool, estimate, int(d.lease.meter.worst.output)
                )
                held.append((d, estimate))
        for b in budget_status(core, now):
            assert b["used"] + b["held"] <= b["limit"], b  # never above, at any instant
    return served


def ledger(store: Store) -> dict[str, float]:
    totals: dict[str, float] = {}
    for row in store.pending_usage("p", 1_900_000_000.0, 10**6).rows:
        for k, v in row.values.items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def check(core: DecisionCore, served: dict[str, float]) -> None:
    (status,) = budget_status(core, 1_800_000_100.0)
    assert status["used"] + status["held"] <= status["limit"]
    totals = ledger(core.store)
    assert totals.get("input", 0) == served["input"]  # the engine's counts, uncapped
    assert totals.get("output", 0) == served["output"]
    assert totals.get("over_tokens", 0) == pytest.approx(served["over_tokens"])
    assert totals.get("over_cost", 0) == served["over_cost"]


@pytest.mark.parametrize("seed", range(12))
def test_an_engine_counting_more_never_takes_a_budget_over_its_limit(seed: int) -> None:
    rng = random.Random(seed)
    core = DecisionCore(generated_config(rng), MemoryStore(), now=1_800_000_000.0)
    served = run(core, rng)
    assert served["over_tokens"] > 0  # the case happened
    check(core, served)


@pytest.mark.parametrize("seed", range(3))
def test_on_redis_likewise(seed: int, redis_url: str) -> None:
    from tokenpools.state.redis.store import RedisStore

    rng = random.Random(seed)
    store = RedisStore(redis_url, prefix=secrets.token_hex(4), timeout_s=2.0)
    core = DecisionCore(generated_config(rng), store, now=1_800_000_000.0)
    served = run(core, rng)
    check(core, served)
