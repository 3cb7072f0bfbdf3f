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
        holds, needs = meter.holds, meter.needs
        for i in range(len(holds)):
            hold, need = holds[i], needs[i]
            c = self._counters.get(hold.key)
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
        holds, needs = meter.holds, meter.needs
        for i in range(len(holds)):
            hold, need = holds[i], needs[i]
            c = self._counters.get(hold.key)
            if c is None:
                c = self._counters[hold.key] = _Counter(until=hold.until)
            c.held += need
            left.append(hold.limit - (c.used + c.held))
        return tuple(left)

    def charge(self, meter: Meter, charge: Charge) -> None:
        """A lease ended: its holds go, its charge is used."""
        holds, needs = meter.holds, meter.needs
        for i in range(len(holds)):
            hold = holds[i]
            c = self._counters[hold.key]
            c.held -= needs[i]
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


@dataclass(slots=True)
class _Hour:
    """One hour of one ledger bucket, as counted here."""

    pool: str
    hour: int
    values: dict[str, float] = field(default_factory=dict)
    version: int = 0

    def row(self, source: str, bucket: str) -> UsageRow:
        return UsageRow(source, self.hour, bucket, dict(self.values), self.version)


class UsageBook:
    """Usage buckets: each bucket's latest hour is open (one lookup per event, by the bucket's
    name, which names its entitlement and so its pool); a bucket's earlier hours wait, closed,
    until taken. Written on every lease end and refusal: plain dict increments."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._open: dict[str, _Hour] = {}  # bucket -> its latest hour
        self._closed: list[tuple[str, _Hour]] = []  # earlier hours changed since the last take
        self._dirty: set[str] = set()  # buckets whose open hour changed since the last take

    def _values(self, pool: str, bucket: str, now: float) -> dict[str, float]:
        hour = int(now // HOUR) * HOUR
        h = self._open.get(bucket)
        if h is None or hour > h.hour:
            if h is not None and bucket in self._dirty:
                self._closed.append((bucket, h))
            h = self._open[bucket] = _Hour(pool, hour)
        h.version += 1
        self._dirty.add(bucket)
        return h.values

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
        """The pool's hours changed since the last take; hours that can no longer change
        (not a bucket's latest) are forgotten once taken."""
        rows = [h.row(self.source, b) for b, h in self._closed if h.pool == pool]
        self._closed = [(b, h) for b, h in self._closed if h.pool != pool]
        for bucket in [b for b in self._dirty if self._open[b].pool == pool]:
            self._dirty.discard(bucket)
            rows.append(self._open[bucket].row(self.source, bucket))
        return rows

    def put_back(self, pool: str, rows: Sequence[UsageRow]) -> None:
        """Rows taken but not written: taken again (the newest totals of each hour)."""
        for row in rows:
            h = self._open.get(row.bucket)
            if h is not None and h.hour == row.hour:
                self._dirty.add(row.bucket)  # its newest totals are still here
            elif not any(b == row.bucket and c.hour == row.hour for b, c in self._closed):
                again = _Hour(pool, row.hour, dict(row.values), row.version)
                self._closed.append((row.bucket, again))
