"""Usage read back for people: buckets grouped by what is asked (tenant, entitlement, key,
model) and by period (hour, day, month in the configured time zone), as rows or CSV."""

from __future__ import annotations

import csv
import io
import zoneinfo
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tokenpools.model.budgets import format_money
from tokenpools.usage.database import TOTALS, Bucket

DIMENSIONS = ("tenant", "entitlement", "key", "model")
PERIODS = ("hour", "day", "month", "all")
_FIELD = {"tenant": "tenant", "entitlement": "entitlement", "key": "key_label", "model": "model"}


def period_start(hour: int, period: str, zone: zoneinfo.ZoneInfo) -> tuple[str, float | None]:
    """The period an hour falls in: its name, and its start in epoch seconds."""
    if period == "all":
        return "", None
    local = datetime.fromtimestamp(hour, zone)
    if period == "hour":
        return local.isoformat(timespec="minutes"), float(hour)
    day = local.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day.date().isoformat(), day.timestamp()
    return f"{local.year:04d}-{local.month:02d}", day.replace(day=1).timestamp()


def group(
    buckets: Sequence[Bucket], by: Sequence[str], period: str, zone: zoneinfo.ZoneInfo
) -> list[dict[str, Any]]:
    """One row per period and value of the `by` dimensions, sorted; totals summed."""
    rows: dict[tuple[str, ...], dict[str, Any]] = {}
    for b in buckets:
        names = tuple(getattr(b, _FIELD[d]) for d in by)
        name, start = period_start(b.hour, period, zone)
        key = (name, *names)
        row = rows.get(key)
        if row is None:
            row = rows[key] = {"period": name, "start": start, **dict(zip(by, names, strict=True))}
            row.update(dict.fromkeys(TOTALS, 0))
            row["refusals"] = {}
        for column, value in b.totals.items():
            row[column] += value
        for reason, count in b.refusals.items():
            row["refusals"][reason] = row["refusals"].get(reason, 0) + count
    out = [rows[k] for k in sorted(rows)]
    for row in out:
        for column in TOTALS:
            if column != "weighted_tokens":
                row[column] = int(row[column])
        row["cost"] = format_money(row["cost_micros"])
    return out


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if not rows:
        return ""
    columns = [c for c in rows[0] if c not in ("refusals", "start")] + ["refusals"]
    writer = csv.writer(buf)
    writer.writerow(columns)
    for row in rows:
        refusals = ";".join(f"{k}={int(v)}" for k, v in sorted(row["refusals"].items()))
        writer.writerow([refusals if c == "refusals" else row[c] for c in columns])
    return buf.getvalue()
