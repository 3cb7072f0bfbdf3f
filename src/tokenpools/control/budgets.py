"""Budgets, decided: which budgets a request is charged against, their current windows in
the configured time zone, what a request may cost at most (its reservation) and what it cost,
and how a refusal is said. Pure: the host passes the time; the store keeps the counters.

A request reserves its worst case (prompt, plus max_tokens × sequences, priced as if no
prompt token were cached) in every budget that applies, in the same store step as the
capacity checks; its end charges what the engine reported (or, ended without usage, what the
store's rules charge) and gives the rest back. So the sum charged and held in a window never
exceeds its limit, whatever the number of replicas."""

from __future__ import annotations

import math
import zoneinfo
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol

from tokenpools.control.decisions import Check, Reason, Reject
from tokenpools.control.metering import BudgetHold, Charge, Meter
from tokenpools.control.store import INF, Store
from tokenpools.model.budgets import Budget, Measure, Period, Scope, format_money
from tokenpools.model.config import Config
from tokenpools.model.entitlement import Entitlement
from tokenpools.model.pool import Pool
from tokenpools.model.request import Account, Usage

SEP = "\x1f"  # between a ledger bucket's parts: no name may hold it


def bucket_of(account: Account, entitlement: str) -> str:
    return SEP.join((account.tenant, entitlement, account.key, account.model))


def window(period: Period, zone: zoneinfo.ZoneInfo, now: float) -> tuple[float, float]:
    """The window holding `now`: [start, end) in epoch seconds, aligned in `zone` (days start
    at local midnight, weeks on Monday, months on the 1st; a DST change is a 23/25-hour day).
    Hours are whole UTC hours, as the ledger's: local hours in every whole-hour zone, and no
    overlapping or missing hour where a DST change moves a half-hour zone by 30 minutes."""
    if period == Period.LIFETIME:
        return 0.0, INF
    if period == Period.HOUR:
        start = now - now % 3600
        return start, start + 3600
    local = datetime.fromtimestamp(now, zone)
    day = local.replace(hour=0, minute=0, second=0, microsecond=0, tzinfo=None)
    if period == Period.WEEK:
        day -= timedelta(days=day.weekday())
        end = day + timedelta(days=7)
    elif period == Period.MONTH:
        day = day.replace(day=1)
        end = (day + timedelta(days=32)).replace(day=1)
    else:
        end = day + timedelta(days=1)
    return day.replace(tzinfo=zone).timestamp(), end.replace(tzinfo=zone).timestamp()


def worst_case(pool: Pool, input_tokens: int, output_tokens: int) -> Charge:
    """The most a request may cost: its prompt uncached, every sequence at its ceiling."""
    p = pool.prices
    tokens = pool.input_token_weight * input_tokens + pool.output_token_weight * output_tokens
    price = input_tokens * p.input + output_tokens * p.output
    cost = float(-(-price // 1_000_000)) if price else 0.0
    return Charge(float(input_tokens), float(output_tokens), 0.0, tokens, cost)


def used(pool: Pool, usage: Usage) -> Charge:
    """What a finished request cost: its cached prompt tokens at the cached price."""
    p = pool.prices
    cached = min(usage.cached_tokens, usage.input_tokens)
    fresh = usage.input_tokens - cached
    return Charge(
        input=float(usage.input_tokens),
        output=float(usage.output_tokens),
        cached=float(cached),
        tokens=pool.input_token_weight * usage.input_tokens
        + pool.output_token_weight * usage.output_tokens,
        cost=float(
            _micros(fresh * p.input + cached * p.cached_input + usage.output_tokens * p.output)
        ),
    )


def _micros(per_million: int) -> int:
    """Micro-units from (tokens × micro-units per million), rounded up: a budget is never
    under-charged; at most one micro-unit per request above the exact price."""
    return -(-per_million // 1_000_000)


class Budgets:
    """The configured budgets, indexed by what they apply to."""

    def __init__(self, config: Config) -> None:
        self.zone = zoneinfo.ZoneInfo(config.usage.time_zone)
        self.by_name: Mapping[str, Budget] = config.budgets
        self._by: dict[tuple[Scope, str], list[Budget]] = {}
        for budget in config.budgets.values():
            self._by.setdefault((budget.scope, budget.target), []).append(budget)
        self._home = {b.name: _home(b, config.entitlements) for b in config.budgets.values()}
        # Windows change once an hour at most: each request's holds are remembered until the
        # soonest of their windows ends (the admission path computes no dates).
        self._holds: dict[
            tuple[Account, str], tuple[float, float, tuple[BudgetHold, ...], str]
        ] = {}

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def spanning(self) -> list[str]:
        """The budgets whose requests go to several pools (one Redis can keep their counters
        beside every pool; a Redis Cluster cannot: their counters and pools are in different
        hash slots)."""
        return sorted(name for name, home in self._home.items() if not home)

    def applying(self, account: Account, ent: Entitlement) -> list[Budget]:
        by = self._by
        if not by:
            return []
        return [
            *by.get((Scope.TENANT, account.tenant), ()),
            *by.get((Scope.ENTITLEMENT, ent.name), ()),
            *by.get((Scope.KEY, f"{account.tenant}/{account.key}"), ()),
        ]

    def hold(self, budget: Budget, now: float) -> BudgetHold:
        start, end = window(budget.period, self.zone, now)
        if end == INF:
            key, start = f"{budget.name}@lifetime", -INF
        else:
            key = f"{budget.name}@{int(start)}"
        measure, limit, home = budget.measure.value, float(budget.limit), self._home[budget.name]
        return BudgetHold(key, measure, limit, end, start, budget.name, home)

    def meter(
        self, account: Account, ent: Entitlement, pool: Pool, inp: int, out: int, now: float
    ) -> Meter:
        holds, bucket = self.holds(account, ent, now)
        worst = worst_case(pool, inp, out)
        if not holds:
            return Meter(holds, bucket, worst)
        needs = []
        for hold in holds:
            needs.append(getattr(worst, hold.measure))
        return Meter(holds, bucket, worst, tuple(needs))

    def holds(
        self, account: Account, ent: Entitlement, now: float
    ) -> tuple[tuple[BudgetHold, ...], str]:
        """A caller's budget holds at `now` and its ledger bucket, remembered (one lookup per
        request) until the soonest of those windows ends."""
        at = (account, ent.name)
        cached = self._holds.get(at)
        if cached is not None and cached[0] <= now < cached[1]:
            return cached[2], cached[3]
        holds = tuple(self.hold(b, now) for b in self.applying(account, ent))
        if len(self._holds) > 65536:
            self._holds.clear()
        start = max((h.start for h in holds), default=-INF)
        end = min((h.until for h in holds), default=INF)
        bucket = bucket_of(account, ent.name)
        self._holds[at] = (start, end, holds, bucket)
        return holds, bucket

    def budget_of(self, hold: BudgetHold) -> Budget:
        return self.by_name[hold.budget]

    def refusal(
        self, meter: Meter, index: int, left: float, now: float, max_tokens_fit: int = 0
    ) -> Reject:
        """429 insufficient_quota naming the budget; Retry-After until its window resets (a
        lifetime budget never does: not retryable). `max_tokens_fit` > 0: the budgets allow
        the request with max_tokens lowered to it."""
        hold = meter.holds[index]
        budget = self.budget_of(hold)
        need = meter.needs[index]
        message = (
            f"budget {budget.name!r} ({budget.scope.value} {budget.target!r}, "
            f"{describe(budget)}) has {amount(budget.measure, max(0.0, left))} left"
            f"{'' if budget.period == Period.LIFETIME else ' this ' + budget.period.value}; "
            f"this request may use up to {amount(budget.measure, need)}"
        )
        wait = None if hold.until == INF else max(0.0, hold.until - now)
        return Reject(
            Reason.INSUFFICIENT_QUOTA,
            Check.BUDGET,
            message,
            wait,
            budget=budget.name,
            max_tokens_fit=max_tokens_fit,
        )

    def fitting_output(
        self, meter: Meter, left: tuple[float, ...], pool: Pool, sequences: int
    ) -> int:
        """The largest max_tokens whose worst case fits what every budget has left, where each
        budget that cannot take the request allows lowering (0: none fits, or one does not)."""
        best = math.inf
        for hold, rest in zip(meter.holds, left, strict=True):
            if getattr(meter.worst, hold.measure) <= rest:
                continue
            if not self.budget_of(hold).lower_max_tokens:
                return 0
            best = min(best, _max_output(hold.measure, rest, meter.worst.input, pool, sequences))
        return 0 if best == math.inf or best < 1 else int(best)


def _max_output(measure: str, rest: float, inp: float, pool: Pool, n: int) -> float:
    """The most output tokens per sequence whose cost in `measure` fits `rest`."""
    if measure == "output":
        return rest / n
    if measure == "tokens" and pool.output_token_weight > 0:
        return (rest - pool.input_token_weight * inp) / (pool.output_token_weight * n)
    if measure == "cost" and pool.prices.output > 0:  # integers: exactly what worst_case sums
        return (int(rest) * 1_000_000 - int(inp) * pool.prices.input) // (pool.prices.output * n)
    return -1.0  # the prompt alone does not fit, or output is free in this measure


def tightest(meter: Meter | None, left: tuple[float, ...]) -> tuple[str, float, float] | None:
    """The budget closest to its limit after an admission (the least left, as a fraction of
    its limit): its name, what is left, and when its window resets."""
    if meter is None or not left:
        return None
    holds, best = meter.holds, 0
    for i in range(1, len(left)):  # a loop, not min(key=...): once per admitted request
        if left[i] / max(holds[i].limit, 1.0) < left[best] / max(holds[best].limit, 1.0):
            best = i
    hold = holds[best]
    return hold.budget, max(0.0, left[best]), hold.until


def describe(budget: Budget) -> str:
    per = "in total" if budget.period == Period.LIFETIME else f"per {budget.period.value}"
    return f"{amount(budget.measure, budget.limit)} {per}"


def amount(measure: Measure | str, value: float) -> str:
    if measure == Measure.COST:
        return format_money(value)
    return f"{int(value)} {'' if measure == Measure.TOKENS else measure + ' '}tokens"


def _home(budget: Budget, ents: Mapping[str, Entitlement]) -> str:
    """The pool every request the budget covers goes to, if there is one."""
    if budget.scope == Scope.ENTITLEMENT:
        pools = {ents[budget.target].pool} if budget.target in ents else set()
    else:
        tenant = budget.target.split("/", 1)[0]
        pools = {e.pool for e in ents.values() if e.tenant_id == tenant}
    return next(iter(pools)) if len(pools) == 1 else ""


class _HasBudgets(Protocol):
    @property
    def budgets(self) -> Budgets: ...

    @property
    def store(self) -> Store: ...


def budget_status(core: _HasBudgets, now: float) -> list[dict[str, Any]]:
    """Every budget's current window as the store counts it: used, held by requests in
    flight, left, and when it resets (the admin API, metrics, the dashboard, notices)."""
    budgets = core.budgets
    holds = [budgets.hold(b, now) for b in budgets.by_name.values()]
    counted = core.store.budget_usage(holds, now) if holds else []
    out = []
    for budget, hold, (used, held, refused) in zip(
        budgets.by_name.values(), holds, counted, strict=True
    ):
        out.append(
            {
                "name": budget.name,
                budget.scope.value: budget.target,
                "scope": budget.scope.value,
                "target": budget.target,
                "measure": budget.measure.value,
                "window": budget.period.value,
                "limit": budget.limit,
                "used": used,
                "held": held,
                "left": max(0.0, budget.limit - used - held),
                "used_ratio": used / budget.limit if budget.limit else 1.0,
                "exhausted": refused,  # a request did not fit this window
                "resets_at": None if hold.until == INF else hold.until,
                "key": hold.key,
            }
        )
    return out


def crossed(budget: Budget, used: float, held: float, exhausted: bool) -> list[float]:
    """The notice thresholds a budget's window has reached: what is charged and held (the
    requests in flight may still use it) against each fraction of the limit; all of them once
    a request did not fit (an exact budget stops short of its limit)."""
    if exhausted:
        return list(budget.notify_at)
    committed = used + held
    return [t for t in budget.notify_at if committed >= t * budget.limit]


def claim_notices(core: _HasBudgets, now: float) -> list[dict[str, Any]]:
    """The budget notices this replica claimed now: a window's thresholds reached, each
    claimed once across every replica (the store says who); sent by usage/notices.py."""
    notices = []
    budgets = core.budgets
    for row in budget_status(core, now):
        budget = budgets.by_name[row["name"]]
        for threshold in crossed(budget, row["used"], row["held"], row["exhausted"]):
            hold = budgets.hold(budget, now)
            if core.store.claim_notice(hold, threshold, now):
                notices.append({**row, "threshold": threshold, "time": now})
    return notices
