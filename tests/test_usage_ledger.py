"""The usage ledger in SQL, on SQLite and on a real PostgreSQL server: after a flush the SQL
totals equal the store's; flushing the same rows again, or from two replicas reading one Redis,
counts nothing twice; an older version never replaces a newer one; the schema is versioned."""

from __future__ import annotations

import random
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.postgres import postgres_server
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.model.config import parse_config
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.state.memory import MemoryStore
from tokenpools.usage.database import SchemaTooNew, UsageDatabase
from tokenpools.usage.report import group

POOL = {"name": "p", "model": "Qwen3-8B", "prices": {"inputPerMillion": 1, "outputPerMillion": 3},
        "perReplica": {"tokensPerSecond": 1e9, "kvTokens": 10**7, "concurrency": 8}}  # fmt: skip
CONFIG = {
    "pools": [POOL],
    "entitlements": [
        {"name": "a", "tenantId": "acme", "pool": "p", "serviceClass": "elastic", "concurrency": 4},
        {"name": "b", "tenantId": "bolt", "pool": "p", "serviceClass": "spot"},
    ],
}


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UsageDatabase]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'usage.sqlite3'}"
    else:
        url = request.getfixturevalue("pg_url")
    database = UsageDatabase(url)
    database._execute("DELETE FROM usage_buckets")
    database._conn.commit()
    yield database
    database.close()


def traffic(core: DecisionCore, seed: int, start: float) -> dict[str, float]:
    """Random requests of two tenants over three hours; returns what the store charged."""
    rng = random.Random(seed)
    totals = {"requests": 0.0, "input_tokens": 0.0, "output_tokens": 0.0, "cost_micros": 0.0}
    now = start
    for _ in range(300):
        now += rng.uniform(0, 40)
        ent, tenant = rng.choice([("a", "acme"), ("b", "bolt")])
        account = Account(tenant, rng.choice(["k1", "k2"]), rng.choice(["m1", "m2"]))
        d = core.admit(ent, RequestCost(rng.randint(1, 500), 100, 1, account), now)
        if isinstance(d, Admit):
            usage = Usage(int(d.lease.meter.worst.input), rng.randint(0, 100))  # type: ignore[union-attr]
            core.settle(d.lease.lease_id, usage, now + 0.5)
            totals["requests"] += 1
            totals["input_tokens"] += usage.input_tokens
            totals["output_tokens"] += usage.output_tokens
            totals["cost_micros"] += -(
                -(usage.input_tokens * 1_000_000 + usage.output_tokens * 3_000_000) // 1_000_000
            )
    return totals


def summed(db: UsageDatabase) -> dict[str, float]:
    rows = group(db.read(0, 4e9), [], "all", zoneinfo.ZoneInfo("UTC"))
    return {k: rows[0][k] for k in ("requests", "input_tokens", "output_tokens", "cost_micros")}


def test_sql_totals_equal_the_stores_and_a_second_flush_counts_nothing(db: UsageDatabase) -> None:
    core = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
    expected = traffic(core, 1, 1_800_000_000.0)
    rows = core.store.take_usage("p", 1_800_020_000.0)
    assert len({r.hour for r in rows}) >= 2 and len({r.bucket for r in rows}) > 4
    db.write(rows)
    db.write(rows)  # the same rows again: idempotent
    assert summed(db) == expected
    assert core.store.take_usage("p", 1_800_020_000.0) == []  # nothing new to take


def test_an_older_version_never_replaces_a_newer_one(db: UsageDatabase) -> None:
    core = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
    account = Account("acme", "k", "m")
    now = 1_800_000_000.0
    taken = []
    for i in range(2):
        d = core.admit("a", RequestCost(10, 10, 1, account), now + i)
        assert isinstance(d, Admit)
        core.settle(d.lease.lease_id, Usage(10, 5), now + i)
        taken.append(core.store.take_usage("p", now + i))
    db.write(taken[1])  # the newer totals (two requests) first, as a faster replica would
    db.write(taken[0])  # a slower replica's older read arrives late
    assert summed(db)["requests"] == 2


def test_two_replicas_flushing_one_redis_count_once(
    db: UsageDatabase, redis_url: str, redis_client: Any
) -> None:
    from tokenpools.state.redis.store import RedisStore

    config = parse_config(CONFIG)
    one = DecisionCore(config, RedisStore(redis_url, prefix="ledger", timeout_s=2.0), now=0.0)
    two = DecisionCore(config, RedisStore(redis_url, prefix="ledger", timeout_s=2.0), now=0.0)
    expected = traffic(one, 2, 1_800_000_000.0)
    rows_one = one.store.take_usage("p", 1_800_020_000.0)
    assert rows_one and two.store.take_usage("p", 1_800_020_000.0) == []  # taken once
    db.write(rows_one)
    two.store.put_back_usage("p", rows_one, 1_800_020_000.0)  # say one's write failed...
    db.write(two.store.take_usage("p", 1_800_020_000.0))  # ...and two wrote them as well
    assert summed(db) == expected


def test_a_newer_schema_is_left_alone(db: UsageDatabase) -> None:
    db._execute("INSERT INTO tokenpools_schema (version) VALUES (99)")
    db._conn.commit()
    with pytest.raises(SchemaTooNew, match="v99 is newer"):
        db.migrate()
    db._execute("DELETE FROM tokenpools_schema WHERE version = 99")
    db._conn.commit()
