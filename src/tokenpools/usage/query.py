"""A usage query as a user writes it (the admin API's parameters, the CLI's options),
checked: a bad value is an error naming it."""

from __future__ import annotations

import zoneinfo
from dataclasses import dataclass
from datetime import datetime

from tokenpools.usage.report import DIMENSIONS, PERIODS


class BadQuery(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class UsageQuery:
    start: float
    end: float
    by: tuple[str, ...]
    per: str


def parse_time(value: str, zone: zoneinfo.ZoneInfo, name: str) -> float:
    """Epoch seconds, or an ISO date/datetime (local to `zone` unless it says its offset)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise BadQuery(f"{name}: {value!r} is neither epoch seconds nor an ISO date") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=zone)
    return moment.timestamp()


def parse_query(params: dict[str, str], zone: zoneinfo.ZoneInfo, now: float) -> UsageQuery:
    unknown = set(params) - {"from", "to", "by", "per", "format"}
    if unknown:
        raise BadQuery(f"unknown parameter(s): {', '.join(sorted(unknown))}")
    local = datetime.fromtimestamp(now, zone)
    month = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
    start = parse_time(params["from"], zone, "from") if "from" in params else month
    end = parse_time(params["to"], zone, "to") if "to" in params else now + 3600
    if end <= start:
        raise BadQuery(f"to must be after from (from {start:g}, to {end:g})")
    by = tuple(d for d in params.get("by", "tenant").split(",") if d)
    bad = [d for d in by if d not in DIMENSIONS]
    if bad or len(set(by)) != len(by):
        raise BadQuery(f"by: {','.join(by)!r}; give distinct ones of {', '.join(DIMENSIONS)}")
    per = params.get("per", "day")
    if per not in PERIODS:
        raise BadQuery(f"per: {per!r}; one of {', '.join(PERIODS)}")
    return UsageQuery(start, end, by, per)
