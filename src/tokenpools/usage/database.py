"""The usage ledger in SQL: SQLite (a file, the default) or PostgreSQL (psycopg 3 through a
connection pool), one table of hourly buckets, its schema created and migrated here, versioned.

A row holds a bucket's *totals* as one ledger counted them (`source`: a memory store's life,
or a Redis pool's), with the version those totals had, under the deployment that wrote it.
Writing is an upsert that only ever replaces older totals with newer ones, so a row written
twice — a flush retried after its commit was not acknowledged, or two replicas flushing the
same Redis — is counted once; rows of different sources add up. Every statement runs in its
own short transaction on a connection in autocommit mode: a read never leaves one open, and a
write is committed or rolled back before the connection goes back to the pool. Whatever the
database or its driver raises comes out as `LedgerUnavailable`, naming the cause."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tokenpools.control.budgets import SEP
from tokenpools.control.metering import UsageRow

SCHEMA_VERSION = 2
KEY = ("deployment", "source", "hour", "tenant", "entitlement", "key_label", "model")
# column -> the store's name for it
TOTALS = {
    "requests": "requests",
    "input_tokens": "input",
    "output_tokens": "output",
    "cached_tokens": "cached",
    "weighted_tokens": "tokens",
    "cost_micros": "cost",
    "evictions": "evicted",
    "expirations": "expired",
    "over_reserved_tokens": "over_tokens",  # served beyond the reservation: not in budgets
    "over_reserved_cost_micros": "over_cost",
}
FRACTIONAL = {"weighted_tokens", "over_reserved_tokens"}  # the rest are whole numbers
_COLUMNS = (*KEY, *TOTALS, "refusals", "version")
_V2_TABLE = (
    "CREATE TABLE usage_buckets_v2 ("
    " deployment TEXT NOT NULL, source TEXT NOT NULL, hour BIGINT NOT NULL,"
    " tenant TEXT NOT NULL, entitlement TEXT NOT NULL, key_label TEXT NOT NULL,"
    " model TEXT NOT NULL, requests BIGINT NOT NULL, input_tokens BIGINT NOT NULL,"
    " output_tokens BIGINT NOT NULL, cached_tokens BIGINT NOT NULL,"
    " weighted_tokens DOUBLE PRECISION NOT NULL, cost_micros BIGINT NOT NULL,"
    " evictions BIGINT NOT NULL, expirations BIGINT NOT NULL,"
    " over_reserved_tokens DOUBLE PRECISION NOT NULL DEFAULT 0,"
    " over_reserved_cost_micros BIGINT NOT NULL DEFAULT 0,"
    " refusals TEXT NOT NULL, version BIGINT NOT NULL,"
    " PRIMARY KEY (deployment, source, hour, tenant, entitlement, key_label, model))"
)
_V1_COLUMNS = (
    "source, hour, tenant, entitlement, key_label, model, requests, input_tokens, output_tokens,"
    " cached_tokens, weighted_tokens, cost_micros, evictions, expirations, refusals, version"
)
_MIGRATIONS = {
    1: [
        "CREATE TABLE usage_buckets ("
        " source TEXT NOT NULL, hour BIGINT NOT NULL, tenant TEXT NOT NULL,"
        " entitlement TEXT NOT NULL, key_label TEXT NOT NULL, model TEXT NOT NULL,"
        " requests BIGINT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,"
        " cached_tokens BIGINT NOT NULL, weighted_tokens DOUBLE PRECISION NOT NULL,"
        " cost_micros BIGINT NOT NULL, evictions BIGINT NOT NULL, expirations BIGINT NOT NULL,"
        " refusals TEXT NOT NULL, version BIGINT NOT NULL,"
        " PRIMARY KEY (source, hour, tenant, entitlement, key_label, model))",
        "CREATE INDEX usage_buckets_hour ON usage_buckets (hour)",
    ],
    # v2: a deployment in every row (v1's rows are the deployment "default"), and what was
    # served beyond a request's reservation
    2: [
        _V2_TABLE,
        f"INSERT INTO usage_buckets_v2 (deployment, {_V1_COLUMNS})"
        f" SELECT 'default', {_V1_COLUMNS} FROM usage_buckets",
        "DROP TABLE usage_buckets",
        "ALTER TABLE usage_buckets_v2 RENAME TO usage_buckets",
        "CREATE INDEX usage_buckets_hour ON usage_buckets (deployment, hour)",
    ],
}
_MIGRATION_LOCK = 0x746F6B70  # a PostgreSQL advisory lock: one migration at a time


class LedgerUnavailable(RuntimeError):
    """The ledger's database could not be used now (down, unreachable, locked past the
    statement timeout, a schema too new); the message names the cause, never a password."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """One row read back: an hour of one tenant × entitlement × key × model."""

    hour: int
    tenant: str
    entitlement: str
    key_label: str
    model: str
    totals: dict[str, float]  # by column name in TOTALS
    refusals: dict[str, float]  # by reason


def redacted(url: str) -> str:
    """A database URL fit for a log line or an error body: its password replaced."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class UsageDatabase:
    """The ledger's table for one deployment. Nothing connects until the first write or read,
    so a gateway starts while its database is down; the schema is migrated then."""

    def __init__(self, url: str, deployment: str = "default", timeout_s: float = 10.0) -> None:
        self.url, self.deployment, self.timeout_s = url, deployment, timeout_s
        self.name = redacted(url)
        self._sqlite: Path | None = None
        self._pool: Any = None
        self._migrated = False
        if url.startswith("sqlite:///"):
            self._sqlite = Path(url.removeprefix("sqlite:///"))
            self._mark = "?"
        else:
            from psycopg_pool import ConnectionPool  # the `postgres` extra, where it is used

            ms = int(timeout_s * 1000)
            self._pool = ConnectionPool(
                url.replace("postgres://", "postgresql://", 1),
                min_size=1,
                max_size=4,
                timeout=timeout_s,  # to wait for a connection
                reconnect_timeout=3600.0,  # keep trying through a long outage
                check=ConnectionPool.check_connection,  # a restarted server's dead ones go
                kwargs={
                    "autocommit": True,
                    "connect_timeout": max(1, round(timeout_s)),
                    # a locked table or a slow disk fails the statement; the rows stay pending
                    "options": f"-c statement_timeout={ms} -c lock_timeout={ms}"
                    f" -c idle_in_transaction_session_timeout={ms * 6}",
                },
                open=False,
                name="tokenpools-usage",
            )
            self._pool.open(wait=False)
            self._mark = "%s"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator[Any]:
        """One short transaction, committed on success; every failure is LedgerUnavailable."""
        try:
            with self._connection() as conn:
                if self._sqlite is not None:
                    conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                    try:
                        yield conn
                    except BaseException:
                        conn.execute("ROLLBACK")
                        raise
                    conn.execute("COMMIT")
                else:
                    with conn.transaction():
                        yield conn
        except LedgerUnavailable:
            raise
        except Exception as exc:  # sqlite3, psycopg, the pool, the filesystem: all alike
            raise LedgerUnavailable(f"usage database {self.name}: {exc}") from exc

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        if self._sqlite is None:
            with self._pool.connection() as conn:
                yield conn
            return
        self._sqlite.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self._sqlite, timeout=self.timeout_s, isolation_level=None)
        try:
            yield conn
        finally:
            conn.close()

    def _execute(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> Any:
        return conn.execute(sql.replace("?", self._mark), params)

    def migrate(self) -> None:
        """Create the schema, or bring it up to this version; a newer one is refused."""
        if self._migrated:
            return
        with self._transaction(write=True) as conn:
            if self._sqlite is None:
                self._execute(conn, f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
            self._execute(
                conn, "CREATE TABLE IF NOT EXISTS tokenpools_schema (version INTEGER NOT NULL)"
            )
            row = self._execute(conn, "SELECT max(version) FROM tokenpools_schema").fetchone()
            current = row[0] or 0
            if current > SCHEMA_VERSION:
                raise LedgerUnavailable(
                    f"{self.name}: usage schema v{current} is newer than this tokenpools "
                    f"(v{SCHEMA_VERSION}); upgrade tokenpools"
                )
            for version in range(current + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[version]:
                    self._execute(conn, statement)
                self._execute(
                    conn, "INSERT INTO tokenpools_schema (version) VALUES (?)", (version,)
                )
        if self._sqlite is not None:
            # readers never wait for the writer; only a speed-up, so a file locked by someone
            # else keeps its mode and is asked again at the next start
            with contextlib.suppress(sqlite3.Error), self._connection() as conn:
                conn.execute("PRAGMA journal_mode=WAL")
        self._migrated = True

    def write(self, rows: Iterable[UsageRow]) -> int:
        """Upsert buckets' totals in one transaction; a row older than the one stored changes
        nothing. In key order, so two writers of the same rows never deadlock."""
        columns = ", ".join(_COLUMNS)
        marks = ", ".join("?" * len(_COLUMNS))
        updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS if c not in KEY)
        sql = (
            f"INSERT INTO usage_buckets ({columns}) VALUES ({marks}) "
            f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {updates} "
            "WHERE usage_buckets.version < excluded.version"
        )
        values = sorted(_values(self.deployment, row) for row in rows)
        if not values:
            return 0
        self.migrate()
        with self._transaction(write=True) as conn:
            if self._sqlite is not None:
                conn.executemany(sql, values)
            else:
                with conn.cursor() as cursor:
                    cursor.executemany(sql.replace("?", self._mark), values)
        return len(values)

    def read(self, start: float, end: float) -> list[Bucket]:
        """Every bucket of this deployment in an hour in [start, end), all sources added up."""
        self.migrate()
        totals = ", ".join(TOTALS)
        with self._transaction(write=False) as conn:
            found = self._execute(
                conn,
                f"SELECT hour, tenant, entitlement, key_label, model, {totals}, refusals "
                "FROM usage_buckets WHERE deployment = ? AND hour >= ? AND hour < ? ORDER BY hour",
                (self.deployment, int(start // 3600 * 3600), int(end)),
            ).fetchall()
        merged: dict[tuple[int, str, str, str, str], Bucket] = {}
        for row in found:
            hour, tenant, ent, key_label, model = int(row[0]), *map(str, row[1:5])
            key = (hour, tenant, ent, key_label, model)
            bucket = merged.get(key)
            if bucket is None:
                zero = dict.fromkeys(TOTALS, 0.0)
                bucket = merged[key] = Bucket(hour, tenant, ent, key_label, model, zero, {})
            for column, value in zip(TOTALS, row[5:-1], strict=True):
                bucket.totals[column] += float(value)
            for reason, count in json.loads(row[-1]).items():
                bucket.refusals[reason] = bucket.refusals.get(reason, 0.0) + count
        return list(merged.values())


def _values(deployment: str, row: UsageRow) -> tuple[Any, ...]:
    tenant, entitlement, key_label, model = row.bucket.split(SEP)
    v = row.values
    totals: list[Any] = [
        float(v.get(name, 0.0)) if column in FRACTIONAL else round(v.get(name, 0.0))
        for column, name in TOTALS.items()
    ]
    refusals = {
        k.removeprefix("refused:"): round(n) for k, n in v.items() if k.startswith("refused:")
    }
    return (
        deployment,
        row.source,
        row.hour,
        tenant,
        entitlement,
        key_label,
        model,
        *totals,
        json.dumps(refusals, sort_keys=True),
        row.version,
    )
