"""What a request is charged beyond capacity: its reservation and charge in every measure a
budget counts (`Charge`), the budget windows it holds (`BudgetHold`, `Meter`), the rule a budget
counts a charge by, and the usage ledger's rows as a store hands them to SQL (`UsageRow`,
`PendingUsage`). Plain values, part of the store port (control/store.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Charge:
    """What a request reserved or used, in every unit a budget counts (a budget's measure,
    model/budgets.py, names one of these fields) and the ledger records."""

    input: float = 0.0  # prompt tokens
    output: float = 0.0  # generated tokens
    cached: float = 0.0  # prompt tokens served from the engine's prefix cache
    tokens: float = 0.0  # the pool's weighted total, as the throughput buckets count it
    cost: float = 0.0  # micro-units

    # written out for mypyc (control/store_terms.py says why, above Lease)
    def __init__(
        self,
        input: float = 0.0,
        output: float = 0.0,
        cached: float = 0.0,
        tokens: float = 0.0,
        cost: float = 0.0,
    ) -> None:
        object.__setattr__(self, "input", input)
        object.__setattr__(self, "output", output)
        object.__setattr__(self, "cached", cached)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "cost", cost)


NO_CHARGE = Charge()


def counted(charge: Charge, worst: Charge, measure: str) -> float:
    """What a budget counts of a request's charge in its measure: at most what the request
    reserved (its worst case), so an engine that counts more prompt tokens than admission
    estimated cannot take a budget over its limit. The ledger keeps the engine's counts and
    records the excess (`overrun`). The Redis script ports this (lua/metering.lua)."""
    if measure == "cached":
        return min(charge.cached, worst.input)
    used: float = getattr(charge, measure)
    cap: float = getattr(worst, measure)
    return min(used, cap)


def overrun(charge: Charge, worst: Charge) -> tuple[float, float]:
    """(weighted tokens, cost) a request's charge has over its reservation: served, recorded
    in the ledger, and not counted by its budgets."""
    return max(0.0, charge.tokens - worst.tokens), max(0.0, charge.cost - worst.cost)


def budget_refund(charge: Charge, worst: Charge, measure: str) -> float:
    """What a budget gives back when a lease charged its worst case (taken back before its
    usage was known) is charged `charge` instead: never negative, so a correction never
    takes a budget up. The Redis script ports this (lua/metering.lua)."""
    return max(0.0, counted(worst, worst, measure) - counted(charge, worst, measure))


def ledger_correction(charge: Charge, worst: Charge) -> dict[str, float]:
    """What a usage-ledger bucket adds when a lease it recorded at its worst case is charged
    `charge` instead (a credit: the differences are negative, except an overrun). The Redis
    script ports this (lua/metering.lua)."""
    over_tokens, over_cost = overrun(charge, worst)
    return {
        "input": charge.input - worst.input,
        "output": charge.output - worst.output,
        "cached": charge.cached - worst.cached,
        "tokens": charge.tokens - worst.tokens,
        "cost": charge.cost - worst.cost,
        "over_tokens": over_tokens,
        "over_cost": over_cost,
    }


@dataclass(frozen=True, slots=True)
class BudgetHold:
    """One budget a request reserves against, in its current window."""

    key: str  # the window's counter: "<budget>@<window start>"
    measure: str  # the Charge field it counts
    limit: float
    until: float  # the window's end (INF: a lifetime budget); its counter may go after it
    start: float  # the window's start (-INF: a lifetime budget)
    budget: str  # its name
    # The pool whose Redis hash slot keeps the counter, when every request the budget covers
    # is in that pool; "" when it spans pools (one Redis, not a Redis Cluster, then).
    home: str = ""


@dataclass(frozen=True, slots=True)
class Meter:
    """What a lease is charged against besides capacity: its budgets (each holds `worst`
    until the lease ends, then the charge) and its usage-ledger bucket."""

    holds: tuple[BudgetHold, ...]
    bucket: str  # "<tenant>\x1f<entitlement>\x1f<key label>\x1f<model>"
    worst: Charge
    needs: tuple[float, ...] = ()  # the worst case in each hold's measure

    def __init__(
        self,
        holds: tuple[BudgetHold, ...],
        bucket: str,
        worst: Charge,
        needs: tuple[float, ...] = (),
    ) -> None:
        object.__setattr__(self, "holds", holds)
        object.__setattr__(self, "bucket", bucket)
        object.__setattr__(self, "worst", worst)
        object.__setattr__(self, "needs", needs)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One usage-ledger bucket's totals: an hour (its start, epoch seconds) of one bucket, as
    one ledger (`source`: a memory store's life, or a Redis pool's) counted them. The version
    grows with every change, so a writer never replaces newer totals with older; rows of
    different sources add up."""

    source: str
    hour: int
    bucket: str
    values: Mapping[str, float]  # requests, input, output, cached, cost, evicted, expired,
    version: int  # over_tokens, over_cost, and "refused:<reason>" per refusal reason


@dataclass(frozen=True, slots=True)
class PendingUsage:
    """A pool's ledger rows not yet written to SQL: the oldest `rows` (at most the limit
    asked), how many there are in all, when the oldest of them first changed (INF: none), and
    how many the store dropped unwritten since the last read (Redis expires a row after 8 days).
    """

    rows: Sequence[UsageRow]
    count: int
    oldest: float
    lost: int = 0
