"""The memory store's budgets and usage ledger: each budget window's counter (used, held) and
each hour's usage bucket, changed in the same step as the lease they belong to. The Redis
script keeps the same numbers (state/redis/lua/metering.lua)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenpools.control.store import INF, Charge, Meter, UsageRow

HOUR = 3600
# A bucket's values: requests, the Charge's measures, evicted, expired, and per refusal
# reason "refused:<reason>" (as the Redis script writes them).


_REFUSED: dict[str, str] = {}  # reason -> its ledger field, made once


@dataclass(slots=True)
class _Counter:
    used: float = 0.0
    held: float = 0.0
    until: float = INF
    refused: bool = False  # a request did not fit: the window is spent, whatever is left
    notified: set[float] = field(default_factory=set)


class BudgetBook:
    def __init__(self) -> None:
        self._counters: dict[str, _Counter] = {}

    def refusing(self, meter: Meter) -> int:
        """The first hold whose window cannot take the worst case (marked refused); -1 if
        all can."""
        for i, hold in enumerate(meter.holds):
            c = self._counters.get(hold.key)
            need = getattr(meter.worst, hold.measure)
            if c is None:
                if need <= hold.limit:
                    continue
                c = self._counters[hold.key] = _Counter(until=hold.until)
            if c.used + c.held + need > hold.limit:
                c.refused = True
                return i
        return -1

    def hold(self, meter: Meter) -> tuple[float, ...]:
        """Hold the worst case in every window; returns what each then has left."""
        left = []
        for hold in meter.holds:
            c = self._counters.get(hold.key)
            if c is None:
                c = self._counters[hold.key] = _Counter(until=hold.until)
            c.held += getattr(meter.worst, hold.measure)
            left.append(hold.limit - (c.used + c.held))
        return tuple(left)

    def charge(self, meter: Meter, charge: Charge) -> None:
        """A lease ended: its holds go, its charge is used."""
        for hold in meter.holds:
            c = self._counters[hold.key]
            c.held -= getattr(meter.worst, hold.measure)
            c.used += getattr(charge, hold.measure)

    def left(self, meter: Meter) -> tuple[float, ...]:
        out = []
        for hold in meter.holds:
            c = self._counters.get(hold.key)
            out.append(hold.limit - (0.0 if c is None else c.used + c.held))
        return tuple(out)

    def usage(self, keys: Sequence[str]) -> list[tuple[float, float, bool]]:
        out = []
        for key in keys:
            c = self._counters.get(key)
            out.append((0.0, 0.0, False) if c is None else (c.used, c.held, c.refused))
        return out

    def claim_notice(self, key: str, threshold: float) -> bool:
        c = self._counters.setdefault(key, _Counter())
        if threshold in c.notified:
            return False
        c.notified.add(threshold)
        return True

    def forget_past(self, now: float) -> None:
        """Windows that have ended and hold nothing are done with."""
        done = [k for k, c in self._counters.items() if c.until <= now and c.held == 0]
        for key in done:
            del self._counters[key]


class UsageBook:
    """Usage buckets by (pool, hour, bucket): the Redis script keeps each pool's in its slot.
    Written on every lease end and refusal: plain dict increments, no generic loops."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._buckets: dict[tuple[str, int, str], dict[str, float]] = {}
        self._versions: dict[tuple[str, int, str], int] = {}
        self._dirty: set[tuple[str, int, str]] = set()

    def _values(self, pool: str, bucket: str, now: float) -> dict[str, float]:
        key = (pool, int(now // HOUR) * HOUR, bucket)
        values = self._buckets.get(key)
        if values is None:
            values = self._buckets[key] = {}
            self._versions[key] = 0
        self._versions[key] += 1
        self._dirty.add(key)
        return values

    def ended(self, pool: str, bucket: str, now: float, charge: Charge, how: str) -> None:
        """A lease ended, charged `charge`; `how`: settled, released, evicted or expired."""
        v = self._values(pool, bucket, now)
        v["requests"] = v.get("requests", 0.0) + 1.0
        for measure, amount in (
            ("input", charge.input),
            ("output", charge.output),
            ("cached", charge.cached),
            ("tokens", charge.tokens),
            ("cost", charge.cost),
        ):
            if amount:
                v[measure] = v.get(measure, 0.0) + amount
        if how == "evicted" or how == "expired":
            v[how] = v.get(how, 0.0) + 1.0

    def refused(self, pool: str, bucket: str, reason: str, now: float) -> None:
        v = self._values(pool, bucket, now)
        name = _REFUSED.get(reason) or _REFUSED.setdefault(reason, f"refused:{reason}")
        v[name] = v.get(name, 0.0) + 1.0

    def take(self, pool: str, now: float) -> list[UsageRow]:
        rows = []
        for key in [k for k in self._dirty if k[0] == pool]:
            self._dirty.discard(key)
            rows.append(
                UsageRow(self.source, key[1], key[2], dict(self._buckets[key]), self._versions[key])
            )
        # Hours before the last are complete once taken: keep only what may still change.
        current = int(now // HOUR) * HOUR - HOUR
        for key in [k for k in self._buckets if k[1] < current and k not in self._dirty]:
            del self._buckets[key]
            del self._versions[key]
        return rows

    def put_back(self, pool: str, rows: Sequence[UsageRow]) -> None:
        for row in rows:
            key = (pool, row.hour, row.bucket)
            if key not in self._buckets:  # dropped meanwhile: restore it as taken
                self._buckets[key] = dict(row.values)
                self._versions[key] = row.version
            self._dirty.add(key)
