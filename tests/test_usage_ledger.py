"""The usage ledger in SQL, on SQLite and on a real PostgreSQL server: after a flush the SQL
totals equal the store's; a row stays pending in the store (memory or Redis) until its commit is
acknowledged, so drawn interleavings of traffic, flushes, flushes cut before their commit or
before their acknowledgement, and late writes of stale reads lose nothing and count nothing
twice; a read leaves no transaction open; deployments sharing a database stay apart; the schema
is versioned and migrated."""

from __future__ import annotations

import os
import random
import secrets
import sqlite3
import zoneinfo
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.postgres import postgres_server
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.control.metering import UsageRow
from tokenpools.control.store import Store
from tokenpools.model.config import parse_config
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.state.memory import MemoryStore
from tokenpools.usage.database import LedgerUnavailable, UsageDatabase
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
    database = UsageDatabase(url, "test")
    database.migrate()
    sql(url, "DELETE FROM usage_buckets")
    yield database
    database.close()


def sql(url: str, statement: str) -> list[Any]:
    """A statement on a connection of the test's own, committed."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            return conn.execute(statement).fetchall()
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement)
        return cursor.fetchall() if cursor.description else []


def pending(store: Store, now: float) -> list[UsageRow]:
    return list(store.pending_usage("p", now, 10**6).rows)


def flush(store: Store, db: UsageDatabase, now: float) -> None:
    rows = pending(store, now)
    db.write(rows)
    store.ack_usage("p", rows, now)


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
    rows = pending(core.store, 1_800_020_000.0)
    assert len({r.hour for r in rows}) >= 2 and len({r.bucket for r in rows}) > 4
    assert pending(core.store, 1_800_020_000.0) == rows  # a read changes nothing
    db.write(rows)
    db.write(rows)  # the same rows again: idempotent
    assert summed(db) == expected
    core.store.ack_usage("p", rows, 1_800_020_000.0)
    assert pending(core.store, 1_800_020_000.0) == []  # nothing left once acknowledged


def test_an_older_version_never_replaces_a_newer_one(db: UsageDatabase) -> None:
    core = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
    account = Account("acme", "k", "m")
    now = 1_800_000_000.0
    taken = []
    for i in range(2):
        d = core.admit("a", RequestCost(10, 10, 1, account), now + i)
        assert isinstance(d, Admit)
        core.settle(d.lease.lease_id, Usage(10, 5), now + i)
        taken.append(pending(core.store, now + i))
    db.write(taken[1])  # the newer totals (two requests) first, as a faster replica would
    db.write(taken[0])  # a slower replica's older read arrives late
    assert summed(db)["requests"] == 2
    core.store.ack_usage("p", taken[0], now + 2)  # an ack of an older version...
    assert pending(core.store, now + 2) == taken[1]  # ...leaves the newer one pending


# A drawn schedule of what happens between traffic: a whole flush; one cut before its commit
# (read, then the database failed); one cut after its commit, before its acknowledgement
# (killed); a read written much later (a slow replica); more traffic.
STEPS = st.lists(
    st.sampled_from(["traffic", "flush", "no-commit", "no-ack", "stale-later"]),
    min_size=1,
    max_size=12,
)


def run_schedule(stores: list[Store], db: UsageDatabase, steps: list[str], seed: int) -> None:
    """`stores`: replicas on one ledger (one memory store, or several RedisStores on one
    Redis). At the end one clean flush: SQL must equal what the store counted."""
    config = parse_config(CONFIG)
    cores = [DecisionCore(config, store, now=0.0) for store in stores]
    rng = random.Random(seed)
    now = 1_800_000_000.0
    expected = dict.fromkeys(("requests", "input_tokens", "output_tokens", "cost_micros"), 0.0)
    stale: list[list[UsageRow]] = []
    for step in steps:
        now += rng.uniform(0, 2000)  # hours close and open
        store = rng.choice(stores)
        if step == "traffic":
            for k, v in traffic(rng.choice(cores), rng.randrange(1 << 30), now).items():
                expected[k] += v
            now += 300 * 40
        elif step == "flush":
            flush(store, db, now)
        elif step == "no-commit":
            pending(store, now)  # read; the write never happens
        elif step == "no-ack":
            db.write(pending(store, now))  # committed; the process dies before the ack
        else:
            stale.append(pending(store, now))
    for rows in stale:  # the slow replica's reads land last
        db.write(rows)
    flush(stores[0], db, now + 10_000)
    assert pending(stores[-1], now + 10_000) == []
    if expected["requests"]:
        assert summed(db) == expected
    else:
        assert group(db.read(0, 4e9), [], "all", zoneinfo.ZoneInfo("UTC")) == []


@settings(max_examples=25, deadline=None, database=None)
@given(steps=STEPS, seed=st.integers(0, 1 << 30))
def test_memory_store_rows_reach_sql_exactly_once_whatever_is_cut(
    steps: list[str], seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    url = f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'usage.sqlite3'}"
    db = UsageDatabase(url, "test")
    try:
        run_schedule([MemoryStore()], db, steps, seed)
    finally:
        db.close()


@settings(max_examples=12, deadline=None, database=None)
@given(steps=STEPS, seed=st.integers(0, 1 << 30))
def test_redis_rows_reach_postgres_exactly_once_across_replicas(
    steps: list[str], seed: int, pg_url: str, redis_url: str
) -> None:
    from tokenpools.state.redis.store import RedisStore

    fresh = secrets.token_hex(4)  # a key prefix and a deployment per example: a clean slate
    stores: list[Store] = [RedisStore(redis_url, prefix=fresh, timeout_s=2.0) for _ in range(2)]
    db = UsageDatabase(pg_url, fresh)
    try:
        run_schedule(stores, db, steps, seed)
    finally:
        db.close()


def test_a_read_leaves_no_transaction_open(pg_url: str) -> None:
    db = UsageDatabase(pg_url, "reads")
    try:
        core = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
        traffic(core, 3, 1_800_000_000.0)
        db.read(0, 4e9)
        flush(core.store, db, 1_800_020_000.0)  # a write after the read: committed at once
        db.read(0, 4e9)
        states = sql(
            pg_url,
            "SELECT state FROM pg_stat_activity WHERE application_name = '' "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
        )
        assert states and all(s != "idle in transaction" for (s,) in states), states
        # and another session sees the write
        (count,) = sql(pg_url, "SELECT count(*) FROM usage_buckets WHERE deployment = 'reads'")
        assert count[0] > 0
    finally:
        db.close()


def test_deployments_sharing_a_database_read_only_their_own(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    ours, theirs = UsageDatabase(url, "prod"), UsageDatabase(url, "demo")
    a = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
    b = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
    expected = traffic(a, 4, 1_800_000_000.0)
    other = traffic(b, 5, 1_800_000_000.0)
    flush(a.store, ours, 1_800_020_000.0)
    flush(b.store, theirs, 1_800_020_000.0)
    assert summed(ours) == expected and summed(theirs) == other


def test_a_v1_ledger_is_migrated_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE tokenpools_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO tokenpools_schema VALUES (1)")
        from tokenpools.usage.database import _MIGRATIONS

        for statement in _MIGRATIONS[1]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO usage_buckets VALUES ('memory:x', 1800000000, 'acme', 'a', 'k', 'm',"
            " 3, 30, 20, 0, 50.0, 7, 0, 0, '{}', 3)"
        )
    db = UsageDatabase(f"sqlite:///{path}")  # the deployment v1's rows belong to
    (bucket,) = db.read(0, 4e9)
    assert bucket.totals["requests"] == 3 and bucket.totals["cost_micros"] == 7
    assert bucket.totals["over_reserved_cost_micros"] == 0
    assert UsageDatabase(f"sqlite:///{path}", "other").read(0, 4e9) == []


def test_a_newer_schema_is_refused_by_name(db: UsageDatabase) -> None:
    sql(db.url, "INSERT INTO tokenpools_schema (version) VALUES (99)")
    try:
        fresh = UsageDatabase(db.url, "test")
        with pytest.raises(LedgerUnavailable, match="v99 is newer"):
            fresh.read(0, 1)
        fresh.close()
    finally:
        sql(db.url, "DELETE FROM tokenpools_schema WHERE version = 99")


def test_an_unreachable_database_is_named_without_its_password() -> None:
    db = UsageDatabase("postgresql://u:s3cret@127.0.0.1:9/x", "d", timeout_s=1.0)
    try:
        with pytest.raises(LedgerUnavailable) as caught:
            db.write(pending_rows())
        assert "s3cret" not in str(caught.value) and "u:***@127.0.0.1:9" in str(caught.value)
    finally:
        db.close()


def pending_rows() -> list[UsageRow]:
    core = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
    traffic(core, 6, 1_800_000_000.0)
    return pending(core.store, 1_800_020_000.0)


def test_the_usage_table_cuts_nothing_when_piped(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tokenpools.cli import app as cli

    url = f"sqlite:///{tmp_path / 'wide.sqlite3'}"
    db = UsageDatabase(url, "wide")
    tenant = "a-tenant-with-a-rather-long-name-" + "x" * 30
    big = {"requests": 123_456_789_012.0, "input": 98_765_432_109_876.0, "cost": 5e12}
    row = UsageRow("memory:x", 1_800_000_000, "\x1f".join((tenant, "e", "k", "m")), big, 1)
    db.write([row])
    db.close()
    out = CliRunner().invoke(
        cli, ["usage", "--database", url, "--deployment", "wide", "--per", "all", "--by",
              "tenant,entitlement,key,model", "--from", "2026-01-01", "--to", "2027-12-31"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert tenant in out.output and "…" not in out.output
    for number in ("123,456,789,012", "98,765,432,109,876", "5000000"):
        assert number in out.output, out.output


def test_the_flusher_keeps_rows_through_failures_and_backs_off_only_while_failing(
    tmp_path: Path,
) -> None:
    import asyncio

    from tokenpools.usage.flusher import Flusher

    async def run(store: Any, *args: Any) -> Any:
        return store(*args)

    core = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
    expected = traffic(core, 7, 1_800_000_000.0)
    clock = [1_800_020_000.0]
    away = UsageDatabase("postgresql://u@127.0.0.1:9/x", "d", timeout_s=1.0)
    flusher = Flusher(run, core.store, away, lambda: clock[0], durable=False)

    async def scenario() -> None:
        for streak in (1, 2, 3):
            with pytest.raises(LedgerUnavailable):
                await flusher.flush(["p"])
            assert flusher.backoff_s(10.0) == min(60.0, 10.0 * 2**streak)
            status = flusher.status()
            assert status.flush_failures == streak and status.pending_rows > 0
            assert status.error is not None and "127.0.0.1:9" in status.error
            clock[0] += 30
        assert flusher.status().oldest_pending_s >= 90  # the first change waits since then
        flusher.database = UsageDatabase(f"sqlite:///{tmp_path / 'back.sqlite3'}", "d")
        assert await flusher.flush(["p"]) > 0
        assert flusher.backoff_s(10.0) == 10.0  # back to the interval at once
        assert flusher.status().pending_rows == 0 and flusher.status().oldest_pending_s == 0
        assert await flusher.flush(["p"]) == 0  # nothing twice

    asyncio.run(scenario())
    assert summed(flusher.database) == expected
    away.close()
    flusher.database.close()


def test_a_memory_store_stopping_with_the_database_away_logs_every_row(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import asyncio
    import json

    from tokenpools.usage.flusher import Flusher

    async def run(store: Any, *args: Any) -> Any:
        return store(*args)

    core = DecisionCore(parse_config(CONFIG), MemoryStore(), now=0.0)
    expected = traffic(core, 8, 1_800_000_000.0)
    away = UsageDatabase("postgresql://u@127.0.0.1:9/x", "d", timeout_s=1.0)
    flusher = Flusher(run, core.store, away, lambda: 1_800_020_000.0, durable=False)
    with caplog.at_level("ERROR", logger="tokenpools.usage"):
        asyncio.run(flusher.final(["p"], timeout_s=5.0))
    away.close()
    records = [
        json.loads(r.getMessage()[r.getMessage().index("{") :])
        for r in caplog.records
        if "not written at shutdown" in r.getMessage()
    ]
    assert len(records) == len(pending(core.store, 1_800_020_000.0))
    assert sum(r["values"].get("requests", 0) for r in records) == expected["requests"]
    assert sum(r["values"].get("cost", 0) for r in records) == expected["cost_micros"]


def test_the_default_ledger_is_each_config_files_own(tmp_path: Path) -> None:
    import yaml

    from tokenpools.model.config import load_config

    paths = [tmp_path / "a" / "gw.yaml", tmp_path / "b" / "gw.yaml", tmp_path / "c.yaml"]
    for path, deployment in zip(paths, ["default", "default", "staging"], strict=True):
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump({**CONFIG, "usage": {"deployment": deployment}}))
    a, b, c = (load_config(p).usage for p in paths)
    assert a.database_url != b.database_url  # same names, other files: other ledgers
    assert load_config(paths[0]).usage.database_url == a.database_url  # a restart: the same
    assert "usage-staging-" in c.database_url and (c.deployment, a.deployment) == (
        "staging",
        "default",
    )
    home = os.environ["XDG_STATE_HOME"]  # the tests' own (conftest), never the user's
    assert all(u.database_url.startswith(f"sqlite:///{home}/tokenpools/") for u in (a, b, c))
