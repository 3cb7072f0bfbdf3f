"""The usage ledger in SQL: SQLite (a file, the default) or PostgreSQL (psycopg 3), one table
of hourly buckets, its schema created and migrated here, versioned.

A row holds a bucket's *totals* as one ledger counted them (`source`: a memory store's life,
or a Redis pool's), with the version those totals had. Writing is an upsert that only ever
replaces older totals with newer ones, so a bucket written twice, or by two replicas reading
the same Redis, is counted once; rows of different sources add up."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenpools.control.budgets import SEP
from tokenpools.control.store import UsageRow

SCHEMA_VERSION = 1
KEY = ("source", "hour", "tenant", "entitlement", "key_label", "model")
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
}
_COLUMNS = (*KEY, *TOTALS, "refusals", "version")
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
}


class SchemaTooNew(RuntimeError):
    pass


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


class UsageDatabase:
    def __init__(self, url: str) -> None:
        self.url = url
        if url.startswith("sqlite:///"):
            path = Path(url.removeprefix("sqlite:///"))
            path.parent.mkdir(parents=True, exist_ok=True)
            self._conn: Any = sqlite3.connect(path, timeout=30, check_same_thread=False)
            self._mark = "?"
        else:
            import psycopg  # the `postgres` extra, only where it is used

            self._conn = psycopg.connect(url.replace("postgres://", "postgresql://", 1))
            self._mark = "%s"
        self.migrate()

    def _transaction(self) -> Any:
        """sqlite3's connection commits as a context; psycopg's would close itself."""
        return self._conn if self._mark == "?" else self._conn.transaction()

    def close(self) -> None:
        self._conn.close()

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(sql.replace("?", self._mark), params)

    def migrate(self) -> None:
        """Create the schema, or bring it up to this version; a newer one is left alone."""
        with self._transaction():
            self._execute("CREATE TABLE IF NOT EXISTS tokenpools_schema (version INTEGER NOT NULL)")
            row = self._execute("SELECT max(version) FROM tokenpools_schema").fetchone()
            current = row[0] or 0
            if current > SCHEMA_VERSION:
                raise SchemaTooNew(
                    f"{self.url}: usage schema v{current} is newer than this tokenpools "
                    f"(v{SCHEMA_VERSION}); upgrade tokenpools"
                )
            for version in range(current + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[version]:
                    self._execute(statement)
                self._execute("INSERT INTO tokenpools_schema (version) VALUES (?)", (version,))

    def write(self, rows: Iterable[UsageRow]) -> int:
        """Upsert buckets' totals; a row older than the one stored changes nothing."""
        columns = ", ".join(_COLUMNS)
        marks = ", ".join("?" * len(_COLUMNS))
        updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS if c not in KEY)
        sql = (
            f"INSERT INTO usage_buckets ({columns}) VALUES ({marks}) "
            f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {updates} "
            "WHERE usage_buckets.version < excluded.version"
        )
        written = 0
        with self._transaction():
            for row in rows:
                self._execute(sql, _values(row))
                written += 1
        return written

    def read(self, start: float, end: float) -> list[Bucket]:
        """Every bucket of an hour in [start, end), all sources added up."""
        totals = ", ".join(f"{c}" for c in TOTALS)
        cursor = self._execute(
            f"SELECT hour, tenant, entitlement, key_label, model, {totals}, refusals "
            "FROM usage_buckets WHERE hour >= ? AND hour < ? ORDER BY hour",
            (int(start // 3600 * 3600), int(end)),
        )
        merged: dict[tuple[int, str, str, str, str], Bucket] = {}
        for row in cursor.fetchall():
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


def _values(row: UsageRow) -> list[Any]:
    tenant, entitlement, key_label, model = row.bucket.split(SEP)
    v = row.values
    totals: list[Any] = [
        float(v.get(name, 0.0)) if column == "weighted_tokens" else round(v.get(name, 0.0))
        for column, name in TOTALS.items()
    ]
    refusals = {
        k.removeprefix("refused:"): round(n) for k, n in v.items() if k.startswith("refused:")
    }
    return [
        row.source,
        row.hour,
        tenant,
        entitlement,
        key_label,
        model,
        *totals,
        json.dumps(refusals, sort_keys=True),
        row.version,
    ]
