"""The memory store's budgets and usage ledger: each budget window's counter (used, held) and
each hour's usage bucket, changed in the same step as the lease they belong to. The Redis
script keeps the same numbers (state/redis/lua/metering.lua)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenpools.control.metering import (
    Charge,
    Meter,
    PendingUsage,
    UsageRow,
    budget_refund,
    counted,
    ledger_correction,
    overrun,
)
from tokenpools.control.store import INF

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
        """A lease ended: its holds go, its charge is used (at most its reservation)."""
        holds, needs = meter.holds, meter.needs
        for i in range(len(holds)):
            hold = holds[i]
            c = self._counters[hold.key]
            c.held -= needs[i]
            c.used += counted(charge, meter.worst, hold.measure)

    def recharge(self, meter: Meter, charge: Charge) -> None:
        """A lease charged its worst case is charged `charge` instead (never more); a window
        given room back is no longer spent (a request that did not fit may fit now)."""
        for hold in meter.holds:
            c = self._counters.get(hold.key)
            back = budget_refund(charge, meter.worst, hold.measure)
            if c is not None and back > 0:
                c.used = max(0.0, c.used - back)
                c.refused = False

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
    bucket: str
    hour: int
    values: dict[str, float] = field(default_factory=dict)
    version: int = 0
    since: float = INF  # when it first changed after its last acknowledged write; INF: written

    def row(self, source: str) -> UsageRow:
        return UsageRow(source, self.hour, self.bucket, dict(self.values), self.version)


class UsageBook:
    """Usage buckets: each bucket's latest hour is open (one lookup per event, by the bucket's
    name, which names its entitlement and so its pool). An hour that changed stays pending, in
    the order it first changed, until a write of its latest version is acknowledged; an hour
    that is no longer a bucket's latest is forgotten then. Written on every lease end and
    refusal: plain dict increments."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._open: dict[str, _Hour] = {}  # bucket -> its latest hour
        self._pending: dict[str, dict[tuple[str, int], _Hour]] = {}  # pool -> oldest first

    def _values(self, pool: str, bucket: str, now: float) -> dict[str, float]:
        hour = int(now // HOUR) * HOUR
        h = self._open.get(bucket)
        if h is None or hour > h.hour:
            h = self._open[bucket] = _Hour(pool, bucket, hour)
        h.version += 1
        if h.since == INF:
            h.since = now
            self._pending.setdefault(pool, {})[(bucket, hour)] = h
        return h.values

    def ended(
        self, pool: str, bucket: str, now: float, charge: Charge, how: str, worst: Charge
    ) -> None:
        """A lease ended, charged `charge` (it reserved `worst`); `how`: settled, released,
        evicted or expired."""
        v = self._values(pool, bucket, now)
        v["requests"] = v.get("requests", 0.0) + 1.0
        over_tokens, over_cost = overrun(charge, worst)
        for measure, amount in (
            ("input", charge.input),
            ("output", charge.output),
            ("cached", charge.cached),
            ("tokens", charge.tokens),
            ("cost", charge.cost),
            ("over_tokens", over_tokens),
            ("over_cost", over_cost),
        ):
            if amount:
                v[measure] = v.get(measure, 0.0) + amount
        if how == "evicted" or how == "expired":
            v[how] = v.get(how, 0.0) + 1.0

    def recharged(self, pool: str, bucket: str, now: float, charge: Charge, worst: Charge) -> None:
        """A lease recorded at its worst case is charged `charge` instead: the difference goes
        in the hour of `now` (a credit, made moments after the lease ended)."""
        v = self._values(pool, bucket, now)
        for measure, amount in ledger_correction(charge, worst).items():
            if amount:
                v[measure] = v.get(measure, 0.0) + amount

    def refused(self, pool: str, bucket: str, reason: str, now: float) -> None:
        v = self._values(pool, bucket, now)
        name = _REFUSED.get(reason) or _REFUSED.setdefault(reason, f"refused:{reason}")
        v[name] = v.get(name, 0.0) + 1.0

    def pending(self, pool: str, limit: int) -> PendingUsage:
        hours = self._pending.get(pool, {})
        rows: list[UsageRow] = []
        for h in hours.values():
            if len(rows) >= limit:
                break
            rows.append(h.row(self.source))
        oldest = next(iter(hours.values())).since if hours else INF
        return PendingUsage(rows, len(hours), oldest)

    def ack(self, pool: str, rows: Sequence[UsageRow]) -> None:
        hours = self._pending.get(pool, {})
        for row in rows:
            h = hours.get((row.bucket, row.hour))
            if h is not None and h.version == row.version:  # not changed since it was read
                del hours[(row.bucket, row.hour)]
                h.since = INF
