"""The usage ledger counts every request exactly once through database faults, end to end: two
real gateway processes (`tokenpools serve`) in front of an emulated engine, on the memory store
and on Redis, write their ledger to a real PostgreSQL server or to a SQLite file, while 16-32
clients of the official (async) openai client send whole answers and streams (n = 1 or 2),
and hypothesis draws the faults: a restart and a lock in either order, perhaps a third of
either kind, each with its own gap and length; on Redis perhaps a kill.

- `outage`: PostgreSQL is shut down (fast: its connections cut, open transactions rolled
  back) for 2.5-3.5 s, then started again on the same data and port. The gateways get
  `usage.databaseTimeoutS: 1`, so that this is an outage to them, not a wait;
- `lock`: the ledger's table is locked from a connection of the test's own for longer than
  `replicaTimeoutS` (PostgreSQL: `LOCK TABLE usage_buckets IN ACCESS EXCLUSIVE MODE`; SQLite:
  `BEGIN EXCLUSIVE`). SQLite has no server to stop: there an outage is a lock too;
- `kill` (Redis only): replica 0 is killed with SIGKILL 0.3-2 s after the first fault began,
  so while its flushes fail or wait: its requests in flight end by lease expiry, and the rows
  it was writing are not lost. On the memory store a SIGKILL loses what was not flushed
  (documented), so memory runs end with a graceful stop instead; nothing may be missing then.

Meanwhile `/admin/usage` is polled on every live replica (the dashboard does every 15 s): it
answers 200, or 503 with an OpenAI error body naming the database while it is down, never
anything else, and leaves no transaction open on PostgreSQL; `/metrics` shows rows pending and
flushes failing during an outage, and no rows pending once the load is over.

At the end the ledger's rows (read with the test's own SQL connection, for this run's
`deployment` only) equal, bucket by bucket (tenant x key x model), what the clients saw
settled: requests, prompt and completion tokens, cost at the pool's prices, no eviction, no
expiry. Requests a client cannot know the charge of (hang-ups mid-stream; requests in flight
at the killed replica) are under keys of their own and checked with bounds. No stream is cut by
a ledger stall: every stream not at the killed replica ends with its final usage chunk, having
streamed every token it counts. `test_long_streams_outlive_a_table_lock` pins the harshest
case: 8 streams of ~8 s across a 5 s table lock on Redis, the database's default timeout (a
flush waits through the whole lock), answers settling meanwhile.

More examples: TOKENPOOLS_FAULT_EXAMPLES=N (2 per store x database by default; the first is
always hypothesis's simplest schedule)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests.postgres import PostgresServer, restartable_postgres
from tokenpools.model.keys import hash_key
from tokenpools.processes import spawn_server

psycopg = pytest.importorskip("psycopg")

LEASE_TTL_S = 2.0
REPLICA_TIMEOUT_S = 2.0
FLUSH_INTERVAL_S = 0.5
DATABASE_TIMEOUT_S = 1.0  # usage.databaseTimeoutS of the drawn runs (Plan)
EMULATOR_SPEED = 0.5  # ~75 tokens/s per stream
MAX_TOKENS = (8, 32, 128, 300)  # 300: a stream of ~4 s
LONG_STREAM = 600  # ~8 s
LOAD_S = 6.0  # the load runs at least this long, and 1 s past the last fault
REPLICAS, VICTIM = 2, 0
TENANTS, MODELS = ("acme", "bolt"), ("m", "m2")
HANG_UP_KEY = "sk-bolt-drop"  # hang-ups: a key of their own, checked with bounds
ADMIN = {"Authorization": "Bearer sk-admin"}
USAGE_QUERY = {"per": "all", "by": "tenant,key,model"}
DRAIN_S = 30.0  # after the load: how long the gateways may take to end and flush everything

Bucket = tuple[str, str, str]  # tenant, key label, model


def key_of(tenant: str, replica: int) -> tuple[str, str]:
    """Each tenant's key for the clients of one replica, and its label: the killed replica's
    clients have keys of their own, so its uncertain requests stay in buckets of their own."""
    return f"sk-{tenant}-{replica}", f"r{replica}"


# -- fault schedules ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    kind: str  # "outage" (PostgreSQL stopped, then started) or "lock" (the ledger's table)
    gap_s: float  # after the previous fault ends (the first: after the load starts)
    hold_s: float  # down, or locked, this long


@dataclass(frozen=True)
class Schedule:
    faults: tuple[Fault, ...]  # one after the other
    kill_after_s: float | None  # Redis only: SIGKILL replica 0 this long after fault 1 begins
    clients: int
    seed: int


def _seconds(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi).map(lambda s: round(s, 2))


HOLDS = {
    "outage": _seconds(2.5, 3.5),  # over 2 x databaseTimeoutS + flushIntervalS: see fault_checks
    "lock": _seconds(REPLICA_TIMEOUT_S + 0.5, REPLICA_TIMEOUT_S + 1.5),  # past replicaTimeoutS
}


@st.composite
def fault_lists(draw: st.DrawFn) -> tuple[Fault, ...]:
    """A restart and a lock, in either order, perhaps a third of either kind; drawn gaps and
    lengths."""
    kinds = draw(st.permutations(["outage", "lock"]))
    kinds += draw(st.lists(st.sampled_from(["outage", "lock"]), max_size=1))
    return tuple(Fault(k, draw(_seconds(0.3, 1.0)), draw(HOLDS[k])) for k in kinds)


SCHEDULES = st.builds(
    Schedule,
    fault_lists(),
    _seconds(0.3, 2.0) | st.none(),
    st.integers(16, 32),
    st.integers(0, 2**16),
)


@dataclass(frozen=True)
class Plan:
    store: str  # memory | redis
    database: str  # postgres | sqlite
    schedule: Schedule
    long_streams: bool = False  # half the clients stream LONG_STREAM tokens, half short answers
    # usage.databaseTimeoutS: how long a flush or /admin/usage waits for the database before
    # it counts as unreachable (a failure; a 503). Short, so that the drawn outages are
    # outages; None: the default (10 s), so that a flush blocks through a whole table lock.
    database_timeout_s: float | None = DATABASE_TIMEOUT_S

    @property
    def kills(self) -> bool:
        return self.store == "redis" and self.schedule.kill_after_s is not None


# -- what the test sees ------------------------------------------------------------------------


@dataclass
class Uncertain:
    """A request whose charge a client cannot know exactly: it hung up mid-stream, or it was in
    flight at the replica killed."""

    admitted: bool  # for certain (a stream had begun); else perhaps
    tokens_bound: int  # at most this many tokens charged (its whole reservation, generously)
    may_expire: bool  # its lease may end by expiry (its replica was killed)


@dataclass
class Window:
    kind: str  # outage | lock
    start: float  # monotonic: down (stopped) / locked (the lock taken)
    end: float  # up again (start called) / unlocked


@dataclass
class AdminCall:
    replica: int
    start: float
    end: float
    status: int  # 0: no answer
    body: Any


@dataclass
class Seen:
    settled: dict[Bucket, Counter[str]] = field(default_factory=dict)
    uncertain: dict[Bucket, list[Uncertain]] = field(default_factory=dict)
    kinds: Counter[str] = field(default_factory=Counter)
    streams: list[tuple[float, float]] = field(default_factory=list)  # settled: began, ended
    unexpected: list[str] = field(default_factory=list)  # client errors not due to the kill
    problems: list[str] = field(default_factory=list)  # everything else that went wrong
    windows: list[Window] = field(default_factory=list)
    admin: list[AdminCall] = field(default_factory=list)
    metrics: list[tuple[float, int, dict[str, float | None]]] = field(default_factory=list)
    open_transactions: list[str] = field(default_factory=list)
    killed_at: float | None = None
    ledger: dict[Bucket, dict[str, float]] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def at(self, t: float) -> str:
        return f"t={t - self.t0:.2f}s"

    def around(self, window: Window) -> str:
        """What /admin/usage answered and /metrics said around a fault: for a failure message."""

        def value(v: float | None) -> str:
            return "-" if v is None else f"{v:g}"

        calls = [
            f"{self.at(c.start)}..{c.end - self.t0:.2f}s replica {c.replica}: {c.status}"
            for c in self.admin
            if c.end >= window.start and c.start <= window.end
        ]
        samples = [
            f"{self.at(t)} replica {r}: {' '.join(map(value, values.values()))}"
            for t, r, values in self.metrics
            if window.start - 0.5 <= t <= window.end + 2.0
        ]
        return (
            f"{window.kind} {self.at(window.start)}..{window.end - self.t0:.2f}s;"
            f" /admin/usage calls: {calls}; {', '.join(LEDGER_METRICS)}: {samples}"
        )

    def settle(self, bucket: Bucket, prompt: int, completion: int) -> None:
        totals = self.settled.setdefault(bucket, Counter())
        totals.update(requests=1, input_tokens=prompt, output_tokens=completion)

    def uncertain_request(self, bucket: Bucket, what: Uncertain) -> None:
        self.uncertain.setdefault(bucket, []).append(what)


# -- the ledger's database, as the test sees and breaks it -------------------------------------

LEDGER_COLUMNS = ("requests", "input_tokens", "output_tokens", "cached_tokens",
                  "weighted_tokens", "cost_micros", "evictions", "expirations")  # fmt: skip


def _summed(rows: list[tuple[Any, ...]]) -> dict[Bucket, dict[str, float]]:
    """Rows of (tenant, key_label, model, *LEDGER_COLUMNS, refusals JSON), every source and
    hour added up per (tenant, key_label, model)."""
    out: dict[Bucket, dict[str, float]] = {}
    for tenant, label, model, *values, refusals in rows:
        totals = out.setdefault((tenant, label, model), dict.fromkeys(LEDGER_COLUMNS, 0.0))
        totals.setdefault("refusals", 0.0)
        for column, value in zip(LEDGER_COLUMNS, values, strict=True):
            totals[column] += float(value)
        totals["refusals"] += sum(json.loads(refusals or "{}").values())
    return out


_SELECT = (
    f"SELECT tenant, key_label, model, {', '.join(LEDGER_COLUMNS)}, refusals "
    "FROM usage_buckets WHERE deployment = {mark}"
)


class Postgres:
    """The gateways' PostgreSQL: stopped and started again, its table locked, read."""

    def __init__(self, server: PostgresServer) -> None:
        self.server, self.url = server, server.url
        self.own_pids: set[int] = set()  # connections of the test's own

    def _connect(self, **kw: Any) -> Any:
        return psycopg.connect(self.url, connect_timeout=5, **kw)

    async def outage(self, hold_s: float, seen: Seen) -> None:
        await asyncio.to_thread(self.server.stop, "fast")
        down = time.monotonic()
        await asyncio.sleep(hold_s)
        seen.windows.append(Window("outage", down, time.monotonic()))
        await asyncio.to_thread(self.server.start)

    async def _table(self) -> None:
        """Until the gateways have created the ledger's table (their first flush)."""

        def exists() -> bool:
            with self._connect(autocommit=True) as conn:
                row = conn.execute("SELECT to_regclass('usage_buckets')").fetchone()
                return row[0] is not None

        await until(lambda: asyncio.to_thread(exists), 15, "the ledger's table exists")

    async def lock(self, hold_s: float, seen: Seen) -> None:
        await self._table()
        conn = await asyncio.to_thread(self._connect)
        try:
            self.own_pids.add(conn.info.backend_pid)
            try:
                await asyncio.to_thread(_pg_lock, conn)
            except psycopg.errors.LockNotAvailable as exc:
                seen.problems.append(
                    f"could not lock usage_buckets within 5 s (a gateway's transaction holds "
                    f"it: left open?): {exc}"
                )
                return
            locked = time.monotonic()
            await asyncio.sleep(hold_s)
            await asyncio.to_thread(conn.rollback)
            seen.windows.append(Window("lock", locked, time.monotonic()))
        finally:
            await asyncio.to_thread(conn.close)

    def open_transactions(self) -> list[str]:
        """Connections not the test's own that have sat idle inside a transaction for over a
        second (between two statements of a flush they do for microseconds)."""
        with self._connect(autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid, application_name, state, now() - state_change, left(query, 120) "
                "FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND state LIKE 'idle in transaction%%' AND pid <> pg_backend_pid() "
                "AND NOT (pid = ANY(%s)) AND now() - state_change > interval '1 second'",
                (list(self.own_pids),),
            ).fetchall()
        return [f"pid {pid} ({app!r}) {state} for {age}: {q!r}" for pid, app, state, age, q in rows]

    def read(self, deployment: str) -> dict[Bucket, dict[str, float]]:
        with self._connect(autocommit=True) as conn:
            return _summed(conn.execute(_SELECT.format(mark="%s"), (deployment,)).fetchall())

    def heal(self) -> None:
        self.server.start()


def _pg_lock(conn: Any) -> None:
    conn.execute("SET lock_timeout = '5s'")
    conn.execute("LOCK TABLE usage_buckets IN ACCESS EXCLUSIVE MODE")


class Sqlite:
    """The gateways' SQLite file: locked (BEGIN EXCLUSIVE), read. It has no server to stop, so
    an outage is a lock too."""

    def __init__(self, path: Path) -> None:
        self.path, self.url = path, f"sqlite:///{path}"

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=5, isolation_level=None, check_same_thread=False)

    async def outage(self, hold_s: float, seen: Seen) -> None:
        await self.lock(hold_s, seen)

    async def lock(self, hold_s: float, seen: Seen) -> None:
        def exists() -> bool:
            if not self.path.exists():
                return False
            with contextlib.closing(self._connect()) as conn:
                sql = "SELECT 1 FROM sqlite_master WHERE name = 'usage_buckets'"
                return conn.execute(sql).fetchone() is not None

        await until(lambda: asyncio.to_thread(exists), 15, "the ledger's table exists")
        conn = await asyncio.to_thread(self._connect)
        try:
            try:
                await asyncio.to_thread(conn.execute, "BEGIN EXCLUSIVE")
            except sqlite3.OperationalError as exc:
                seen.problems.append(f"could not lock the SQLite ledger within 5 s: {exc}")
                return
            locked = time.monotonic()
            await asyncio.sleep(hold_s)
            await asyncio.to_thread(conn.execute, "ROLLBACK")
            seen.windows.append(Window("lock", locked, time.monotonic()))
        finally:
            await asyncio.to_thread(conn.close)

    def open_transactions(self) -> list[str]:
        return []

    def read(self, deployment: str) -> dict[Bucket, dict[str, float]]:
        with contextlib.closing(self._connect()) as conn:
            return _summed(conn.execute(_SELECT.format(mark="?"), (deployment,)).fetchall())

    def heal(self) -> None:
        pass


Database = Postgres | Sqlite


# -- the gateways ------------------------------------------------------------------------------


def gateway_config(
    plan: Plan, backend: str, redis_url: str, database: Database, deployment: str
) -> dict[str, Any]:
    state: dict[str, Any] = {"backend": "memory"}
    if plan.store == "redis":
        state = {"backend": "redis", "url": redis_url, "keyPrefix": deployment,
                 "timeoutMs": 1000, "replicaTimeoutS": REPLICA_TIMEOUT_S}  # fmt: skip
    usage = {"database": database.url, "flushIntervalS": FLUSH_INTERVAL_S,
             "deployment": deployment}  # fmt: skip
    if plan.database_timeout_s is not None:
        usage["databaseTimeoutS"] = plan.database_timeout_s
    keys: dict[str, list[dict[str, str]]] = {t: [] for t in TENANTS}
    for tenant in TENANTS:
        for replica in range(REPLICAS):
            key, label = key_of(tenant, replica)
            keys[tenant].append({"hash": hash_key(key), "label": label})
    keys["bolt"].append({"hash": hash_key(HANG_UP_KEY), "label": "drop"})
    return {
        "state": state,
        "policy": {"leaseTtlS": LEASE_TTL_S},
        "gateway": {"adminKeys": [hash_key("sk-admin")]},
        "usage": usage,
        "pools": [{"name": "p", "model": "Llama-3.1-8B", "servedModels": list(MODELS),
                   "prices": {"inputPerMillion": 1, "outputPerMillion": 3},
                   "backends": [{"url": backend, "timeoutS": 60}],
                   "perReplica": {"tokensPerSecond": 1e6, "kvTokens": 1e7, "concurrency": 256}}],
        "entitlements": [{"name": f"{t}-e", "tenantId": t, "pool": "p",
                          "serviceClass": "elastic", "concurrency": 100} for t in TENANTS],
        "tenants": [{"id": t, "keys": keys[t]} for t in TENANTS],
    }  # fmt: skip


async def until(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str, every_s: float = 0.1
) -> None:
    """Poll `check` until it holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if await check():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(every_s)


def metric(text: str, name: str) -> float | None:
    """A Prometheus series' value, summed over its labels; None if it is not there."""
    total = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


LEDGER_METRICS = ("tokenpools_usage_pending_rows", "tokenpools_usage_oldest_pending_seconds",
                  "tokenpools_usage_flush_failures_total")  # fmt: skip


@dataclass
class Run:
    plan: Plan
    urls: list[str]
    procs: list[subprocess.Popen[bytes]]
    database: Database
    seen: Seen = field(default_factory=Seen)
    dead: set[int] = field(default_factory=set)
    stopping: bool = False  # the clients' load
    observing: bool = True  # /metrics, until the gateways are stopped
    fault_began: asyncio.Event = field(default_factory=asyncio.Event)

    def live(self) -> list[int]:
        return [r for r in range(REPLICAS) if r not in self.dead]

    @property
    def t0(self) -> float:
        return self.seen.t0

    def at(self, t: float) -> str:
        return self.seen.at(t)


# -- the clients -------------------------------------------------------------------------------


async def client_loop(run: Run, i: int, clients: dict[tuple[int, str], Any]) -> None:
    rng = random.Random(run.plan.schedule.seed * 1000 + i)
    home = i % REPLICAS
    seen = run.seen
    while not run.stopping:
        replica = home if home not in run.dead else run.live()[0]
        if run.plan.long_streams:
            long = i // REPLICAS % 2 == 0  # as many long streams at each replica
            kind, max_tokens = ("stream", LONG_STREAM) if long else ("whole", 32)
        else:
            kind = rng.choices(("whole", "stream", "hang-up"), (4, 5, 1))[0]
            max_tokens = rng.choice(MAX_TOKENS)
        tenant, model, n = rng.choice(TENANTS), rng.choice(MODELS), rng.choice((1, 1, 2))
        key, label = key_of(tenant, home)
        if kind == "hang-up":
            tenant, (key, label) = "bolt", (HANG_UP_KEY, "drop")
        bucket = (tenant, label, model)
        content = "count " * rng.randint(3, 15)
        bound = len(content) + 16 + max_tokens * n  # the reservation, generously
        client = clients[(replica, key)]
        args: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "n": n,
                                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        began, admitted = time.monotonic(), False
        try:
            if kind == "whole":
                answer = await client.chat.completions.create(**args)
                assert answer.choices and answer.choices[0].finish_reason, answer
                seen.settle(bucket, answer.usage.prompt_tokens, answer.usage.completion_tokens)
            else:
                stream = await client.chat.completions.create(
                    **args, stream=True, stream_options={"include_usage": True}
                )
                admitted = True
                usage, tokens, finished = None, 0, False
                async for chunk in stream:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        tokens += bool(choice.delta.content)  # the emulator: a token a chunk
                        finished = finished or bool(choice.finish_reason)
                    if kind == "hang-up" and tokens:
                        break
                await stream.close()
                if kind == "hang-up":
                    assert tokens, "the stream ended before its first token"
                    seen.uncertain_request(bucket, Uncertain(True, bound, False))
                else:
                    assert usage is not None and finished, (
                        f"the stream ended after {tokens} tokens without its "
                        f"{'usage chunk' if usage is None else 'finish_reason'}"
                    )
                    assert tokens == usage.completion_tokens, (
                        f"cut: {tokens} tokens streamed, {usage.completion_tokens} counted"
                    )
                    seen.settle(bucket, usage.prompt_tokens, usage.completion_tokens)
                    seen.streams.append((began, time.monotonic()))
            seen.kinds[kind] += 1
        except Exception as exc:
            if replica in run.dead:  # in flight at the replica killed: it may have been charged
                seen.uncertain_request(bucket, Uncertain(admitted, bound, True))
                seen.kinds["lost"] += 1
            else:
                seen.unexpected.append(
                    f"{run.at(began)}..{run.at(time.monotonic())} {kind} (n={n}, "
                    f"max_tokens={max_tokens}) via replica {replica}: {type(exc).__name__}: {exc}"
                )
                await asyncio.sleep(0.05)


# -- what runs beside them ---------------------------------------------------------------------


async def inject_faults(run: Run) -> None:
    for fault in run.plan.schedule.faults:
        await asyncio.sleep(fault.gap_s)
        run.fault_began.set()
        breaking = run.database.outage if fault.kind == "outage" else run.database.lock
        await breaking(fault.hold_s, run.seen)


async def kill_victim(run: Run) -> None:
    """SIGKILL replica 0 during the first fault: it is then flushing, or failing to."""
    await run.fault_began.wait()
    assert run.plan.schedule.kill_after_s is not None
    await asyncio.sleep(run.plan.schedule.kill_after_s)
    run.procs[VICTIM].send_signal(signal.SIGKILL)
    run.dead.add(VICTIM)
    run.seen.killed_at = time.monotonic()


async def poll_admin_usage(run: Run, http: httpx.AsyncClient, replica: int) -> None:
    """`/admin/usage` on one replica, again and again; after each answer, no transaction of a
    gateway's may be left open."""
    while not run.stopping and replica not in run.dead:  # not in the drain: it flushes too
        start = time.monotonic()
        try:
            r = await http.get(run.urls[replica] + "/admin/usage", params=USAGE_QUERY,
                               headers=ADMIN, timeout=20)  # fmt: skip
            status, body = r.status_code, _json(r)
        except httpx.HTTPError as exc:
            if replica in run.dead:
                return
            status, body = 0, repr(exc)
        run.seen.admin.append(AdminCall(replica, start, time.monotonic(), status, body))
        with contextlib.suppress(Exception):  # the database may be down
            found = await asyncio.to_thread(run.database.open_transactions)
            run.seen.open_transactions.extend(f"{run.at(time.monotonic())} {f}" for f in found)
        await asyncio.sleep(0.3)


async def sample_metrics(run: Run, http: httpx.AsyncClient) -> None:
    while run.observing:
        for replica in run.live():
            with contextlib.suppress(httpx.HTTPError):
                text = (await http.get(run.urls[replica] + "/metrics", timeout=5)).text
                values = {name: metric(text, name) for name in LEDGER_METRICS}
                run.seen.metrics.append((time.monotonic(), replica, values))
        await asyncio.sleep(0.2)


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


async def drain(run: Run, http: httpx.AsyncClient) -> None:
    """After the load: every request ended (the killed replica's by expiry), every row
    written. Failures are noted, and the ledger compared all the same."""

    async def nothing_in_flight() -> bool:
        for r in run.live():
            pools = (await http.get(run.urls[r] + "/admin/pools", headers=ADMIN)).json()
            if pools["p"]["in_flight"]:
                return False
        return True

    async def nothing_pending() -> bool:
        for r in run.live():
            text = (await http.get(run.urls[r] + "/metrics")).text
            if metric(text, "tokenpools_usage_pending_rows") != 0:
                return False
        return True

    conditions = {
        "no request in flight": nothing_in_flight,
        "tokenpools_usage_pending_rows == 0 on every replica": nothing_pending,
    }
    for what, check in conditions.items():
        try:
            await until(check, DRAIN_S, what)
        except AssertionError as exc:
            run.seen.problems.append(f"after the load: {exc}")
    for r in run.live():  # with the database back, the ledger answers
        url = run.urls[r] + "/admin/usage"
        try:
            answer = await http.get(url, params=USAGE_QUERY, headers=ADMIN, timeout=20)
        except httpx.HTTPError as exc:
            run.seen.problems.append(f"after the load, /admin/usage on replica {r}: {exc!r}")
            continue
        if answer.status_code != 200 or "rows" not in _json(answer):
            run.seen.problems.append(
                f"after the load, /admin/usage on replica {r}: {answer.status_code} {answer.text}"
            )


async def stop_gateways(run: Run) -> None:
    """A graceful stop (SIGTERM) of the live replicas: each flushes what it holds."""
    for r in run.live():
        run.procs[r].send_signal(signal.SIGTERM)
    for r in run.live():
        try:
            await asyncio.to_thread(run.procs[r].wait, 20)
        except subprocess.TimeoutExpired:
            run.seen.problems.append(f"replica {r} did not stop within 20 s of SIGTERM")


# -- one run -----------------------------------------------------------------------------------


async def run_plan(plan: Plan, backend: str, redis_url: str, database: Database, tmp: Path) -> Seen:
    deployment = f"faults-{uuid.uuid4().hex[:12]}"  # this run's rows, whatever else is there
    config = tmp / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(gateway_config(plan, backend, redis_url, database, deployment))
    )
    serve = ["serve", "--config", str(config), "--shutdown-timeout", "5", "--port"]
    started = await asyncio.gather(
        *(spawn_server(lambda p: [*serve, str(p)], "/readyz", 30) for _ in range(REPLICAS)),
        return_exceptions=True,
    )
    procs = [s[0] for s in started if not isinstance(s, BaseException)]
    try:
        for s in started:
            if isinstance(s, BaseException):
                raise s
        run = Run(plan, [url for _, url in started], procs, database)  # type: ignore[misc]
        await exercise(run)
        run.seen.ledger = await asyncio.to_thread(database.read, deployment)
        return run.seen
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        database.heal()


async def exercise(run: Run) -> None:
    async with httpx.AsyncClient() as http:
        keys = [key_of(t, r)[0] for t in TENANTS for r in range(REPLICAS)] + [HANG_UP_KEY]
        clients = {
            (r, key): openai.AsyncOpenAI(
                base_url=run.urls[r] + "/v1", api_key=key, max_retries=0, timeout=30
            )
            for r in range(REPLICAS)
            for key in keys
        }
        observers = [asyncio.create_task(sample_metrics(run, http))] + [
            asyncio.create_task(poll_admin_usage(run, http, r)) for r in range(REPLICAS)
        ]
        load = [
            asyncio.create_task(client_loop(run, i, clients))
            for i in range(run.plan.schedule.clients)
        ]
        faults = [asyncio.create_task(inject_faults(run))]
        if run.plan.kills:
            faults.append(asyncio.create_task(kill_victim(run)))
        try:
            await asyncio.gather(*faults)
            await asyncio.sleep(max(1.0, LOAD_S - (time.monotonic() - run.t0)))
            run.stopping = True
            await asyncio.gather(*load)
            await drain(run, http)
        finally:
            run.stopping, run.observing = True, False
            await asyncio.gather(*load, *observers, return_exceptions=True)
            await asyncio.gather(*(c.close() for c in clients.values()))
        await stop_gateways(run)


# -- the checks --------------------------------------------------------------------------------


def ledger_mismatches(seen: Seen) -> list[str]:
    """Bucket by bucket: the ledger against what the clients saw. Exact where every request's
    usage is known; bounds where some are uncertain (hung up, or at the killed replica)."""
    out = []
    for bucket in sorted(set(seen.ledger) | set(seen.settled) | set(seen.uncertain)):
        got = seen.ledger.get(bucket) or dict.fromkeys((*LEDGER_COLUMNS, "refusals"), 0.0)
        want = seen.settled.get(bucket, Counter())
        unsure = seen.uncertain.get(bucket, [])
        sure = sum(u.admitted for u in unsure)
        at_victim = sum(u.may_expire for u in unsure)
        bound = sum(u.tokens_bound for u in unsure)
        bad = []
        if not sure <= got["requests"] - want["requests"] <= len(unsure):
            saw = f"the clients saw {want['requests']} settled"
            if unsure:
                saw += f" and {len(unsure)} uncertain ({sure} admitted)"
            bad.append(f"requests {got['requests']:g}, {saw}")
        for column in ("input_tokens", "output_tokens"):
            if got[column] < want[column] or (not unsure and got[column] != want[column]):
                bad.append(f"{column} {got[column]:g}, the clients saw {want[column]}")
        extra = sum(got[c] - want[c] for c in ("input_tokens", "output_tokens"))
        if extra > bound:
            bad.append(f"{extra:g} tokens more than the clients saw, over the {bound} reserved")
        if got["cost_micros"] != got["input_tokens"] + 3 * got["output_tokens"]:
            bad.append(f"cost {got['cost_micros']:g} micros, not input + 3 x output")
        if got["weighted_tokens"] != got["input_tokens"] + got["output_tokens"]:
            bad.append(f"weighted tokens {got['weighted_tokens']:g}, not input + output")
        # the emulator's prefix cache serves the prompts these clients repeat: a share of the
        # input, never more (the clients' streams do not show it)
        if not 0 <= got["cached_tokens"] <= got["input_tokens"]:
            bad.append(f"{got['cached_tokens']:g} cached tokens of {got['input_tokens']:g}")
        if got["evictions"]:
            bad.append(f"{got['evictions']:g} evictions")
        if got["expirations"] > at_victim:
            bad.append(f"{got['expirations']:g} expirations ({at_victim} at the killed replica)")
        if got["refusals"]:
            bad.append(f"{got['refusals']:g} refusals")
        if bad:
            out.append(f"{'/'.join(bucket)}: " + "; ".join(bad))
    return out


def fault_checks(seen: Seen, plan: Plan) -> list[str]:
    """/admin/usage's answers, open transactions, the ledger's metrics during outages."""
    out = []
    odd = Counter(
        f"{c.status} {c.body!r}"
        for c in seen.admin
        if c.status not in (200, 503) or (c.status == 503 and not _openai_error(c.body))
    )
    out += [f"/admin/usage answered {answer} ({n} times; only 200, or 503 with an OpenAI error "
            "naming the database, are right)" for answer, n in odd.items()]  # fmt: skip
    timeout_s = plan.database_timeout_s or 10.0  # the gateway's default
    for window in (w for w in seen.windows if w.kind == "outage"):
        down_s = window.end - window.start
        called = [c for c in seen.admin if window.start <= c.start <= window.end]
        # answered while the database was still down: only a 503 is right
        wrong = [c for c in called if c.end <= window.end and c.status != 503]
        bad = [f"/admin/usage answered {len(wrong)} times while the database was down, not with"
               f" a 503: {wrong[0].status} {wrong[0].body!r}"] if wrong else []  # fmt: skip
        # some answer in the outage says so (a call may wait behind a flush, then for its own
        # connection, and the database be back by then: a 200 is right for that one)
        overlapping = [c for c in seen.admin if c.end >= window.start and c.start <= window.end]
        if down_s >= timeout_s + 1.0 and not any(c.status == 503 for c in overlapping):
            bad.append(f"no 503 from /admin/usage during a {down_s:.1f} s outage "
                       f"(databaseTimeoutS {timeout_s:g}; called {len(called)} times)")  # fmt: skip
        # a flush begun while the database was down must fail, within databaseTimeoutS; one
        # may wait first behind another (/admin/usage flushes too) for as long
        if down_s >= 2 * timeout_s + FLUSH_INTERVAL_S:
            bad += _outage_metrics(seen, window, grace_s=timeout_s + 0.5)
        if bad:
            out += [*bad, f"around the outage: {seen.around(window)}"]
    out += [f"a gateway's connection left a transaction open: {t}" for t in seen.open_transactions]
    if plan.kills and seen.killed_at is None:
        out.append("the replica was never killed")
    return out


def _openai_error(body: Any) -> bool:
    """`{"error": {"message", "type", "code"}}`, naming the database as the cause."""
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and all(isinstance(error.get(k), str) and error[k] for k in ("message", "type", "code"))
        and any(w in f"{error['message']} {error['code']}".lower() for w in ("database", "ledger"))
    )


def _outage_metrics(seen: Seen, window: Window, grace_s: float) -> list[str]:
    """During an outage rows wait (pending > 0) and flushes fail (the counter goes up; a flush
    begun during the outage may take databaseTimeoutS to fail: `grace_s` after its end)."""
    pending, failures_rose = False, False
    for replica in range(REPLICAS):
        mine = [(t, v) for t, r, v in seen.metrics if r == replica]
        before = [v[LEDGER_METRICS[2]] for t, v in mine if t <= window.start]
        during = [v for t, v in mine if window.start <= t <= window.end + grace_s]
        pending |= any((v[LEDGER_METRICS[0]] or 0) > 0 for v in during)
        if before and during and before[-1] is not None:
            failures_rose |= any((v[LEDGER_METRICS[2]] or 0) > before[-1] for v in during)
    out = []
    if not any(v[LEDGER_METRICS[0]] is not None for _, _, v in seen.metrics):
        return [f"/metrics has none of {', '.join(LEDGER_METRICS)}"]
    if not pending:
        out.append(
            f"{LEDGER_METRICS[0]} stayed 0 during a {window.end - window.start:.1f} s outage"
        )
    if not failures_rose:
        out.append(
            f"{LEDGER_METRICS[2]} did not rise during a {window.end - window.start:.1f} s outage"
        )
    return out


def check(seen: Seen, plan: Plan) -> None:
    spans = [w for w in seen.windows if w.kind == "lock"]
    across = sum(any(b < w.start and w.end < e for w in spans) for b, e in seen.streams)
    print(
        f"\n{plan}\n  requests {dict(seen.kinds)}, {across} streams settled across a table lock, "
        f"{len(seen.windows)} faults, /admin/usage {dict(Counter(c.status for c in seen.admin))}, "
        f"ledger buckets {len(seen.ledger)}"
    )
    failures = [f"client error not due to the kill: {u}" for u in seen.unexpected[:10]]
    if len(seen.unexpected) > 10:
        failures.append(f"... and {len(seen.unexpected) - 10} more client errors")
    failures += seen.problems + fault_checks(seen, plan)
    failures += [f"ledger != clients: {m}" for m in ledger_mismatches(seen)]
    if sum(seen.kinds[k] for k in ("whole", "stream")) < 50:
        failures.append(f"too little load to show anything: {dict(seen.kinds)}")
    assert not failures, f"{plan}\n  " + "\n  ".join(failures)


# -- fixtures and tests ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    emulate = ["emulate", "--profile", "h100-llama3.1-8b", "--speed", str(EMULATOR_SPEED)]
    proc, url = asyncio.run(spawn_server(lambda p: [*emulate, "--port", str(p)], "/health"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    with restartable_postgres() as server:
        yield server


def run_and_check(plan: Plan, backend: str, redis_url: str, pg: PostgresServer, tmp: Path) -> Seen:
    if plan.store == "redis":
        with contextlib.closing(redis.Redis.from_url(redis_url)) as r:
            r.flushall()
    database: Database = Postgres(pg) if plan.database == "postgres" else Sqlite(tmp / "u.db")
    seen = asyncio.run(run_plan(plan, backend, redis_url, database, tmp))
    check(seen, plan)
    return seen


@pytest.mark.parametrize("database", ["postgres", "sqlite"])
@pytest.mark.parametrize("store", ["memory", "redis"])
@settings(
    max_examples=int(os.environ.get("TOKENPOOLS_FAULT_EXAMPLES", "2")),
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example is a 10-20 s run
)
@given(schedule=SCHEDULES)
def test_the_ledger_counts_each_request_once_through_database_faults(
    store: str,
    database: str,
    schedule: Schedule,
    backend: str,
    redis_url: str,
    pg: PostgresServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    plan = Plan(store, database, schedule)
    run_and_check(plan, backend, redis_url, pg, tmp_path_factory.mktemp("ledger-faults"))


def test_long_streams_outlive_a_table_lock(
    backend: str, redis_url: str, pg: PostgresServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two replicas on Redis; the ledger's table locked for 5 s (over replicaTimeoutS and
    leaseTtlS) while 8 streams of ~8 s run across it and short answers settle meanwhile."""
    schedule = Schedule((Fault("lock", 0.5, 5.0),), None, clients=16, seed=7)
    plan = Plan("redis", "postgres", schedule, long_streams=True, database_timeout_s=None)
    seen = run_and_check(plan, backend, redis_url, pg, tmp_path_factory.mktemp("ledger-lock"))
    (lock,) = seen.windows
    across = [s for s in seen.streams if s[0] < lock.start and lock.end < s[1]]
    assert len(across) >= 8, f"only {len(across)} streams ran across the lock"
