"""Budgets and prices: how much a tenant, an entitlement or a key may use per window, and what
tokens cost. Money is kept in integer micro-units (a millionth of the currency) everywhere;
prices are micro-units per million tokens, so a request's cost is an integer division away."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from pathlib import Path

MICRO = 1_000_000  # micro-units per currency unit


class Measure(StrEnum):
    """What a budget counts."""

    INPUT = "input"  # prompt tokens
    OUTPUT = "output"  # generated tokens
    TOKENS = "tokens"  # the pool's weighted total (input × weight + output × weight)
    COST = "cost"  # money, in micro-units, from the pool's prices


class Period(StrEnum):
    """A budget's window, aligned to the configured time zone (weeks start on Monday)."""

    HOUR = "hour"
    DAY = "day"
    WEEK = "week"
    MONTH = "month"
    LIFETIME = "lifetime"


class Scope(StrEnum):
    TENANT = "tenant"  # every request of the tenant, in every pool
    ENTITLEMENT = "entitlement"  # every request charged to the entitlement
    KEY = "key"  # every request made with one of a tenant's keys, named "<tenant>/<label>"


@dataclass(frozen=True, slots=True)
class Prices:
    """Micro-units per million tokens (0: free)."""

    input: int = 0
    output: int = 0
    cached_input: int = 0


@dataclass(frozen=True, slots=True)
class Budget:
    name: str
    scope: Scope
    target: str  # a tenant id, an entitlement name, or "<tenant>/<key label>"
    measure: Measure
    limit: int  # tokens, or micro-units for cost
    period: Period
    # A request whose worst case does not fit is admitted with max_tokens lowered to what
    # remains (if any output fits), instead of refused.
    lower_max_tokens: bool = False
    notify_at: tuple[float, ...] = (0.8, 1.0)  # fractions of the limit that post a notice


@dataclass(frozen=True, slots=True)
class Webhook:
    url: str
    secret: bytes  # signs each notice (HMAC-SHA256); empty: unsigned
    timeout_s: float = 5.0
    attempts: int = 5


@dataclass(frozen=True, slots=True)
class UsageSettings:
    time_zone: str = "UTC"  # budget windows and the day/month of usage reports
    database: str = ""  # sqlite:///path or postgresql://...; empty: default_database()
    flush_interval_s: float = 10.0
    webhook: Webhook | None = None
    deployment: str = "default"  # every ledger row's, and what reports read
    database_timeout_s: float = 10.0  # a statement, a connection: then the rows wait
    origin: str = ""  # the config file's absolute path ("" when not from a file)

    @property
    def database_url(self) -> str:
        return self.database or default_database(self.deployment, self.origin)


def default_database(deployment: str = "default", origin: str = "") -> str:
    """SQLite in the user's state directory (XDG), so a plain `tokenpools serve` needs no
    server and writes nothing into the working directory: a file per deployment and config
    file, so gateways of unrelated configs on one machine never share a ledger."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    name = deployment
    if origin:
        name += "-" + hashlib.sha256(origin.encode()).hexdigest()[:10]
    return f"sqlite:///{Path(base) / 'tokenpools' / f'usage-{name}.sqlite3'}"


def micro_units(amount: str | float | int) -> int:
    """A money amount written in currency units ("0.50", 12) as integer micro-units, exactly:
    never through a binary float."""
    try:
        value = Decimal(str(amount))
    except InvalidOperation:
        raise ValueError(f"not an amount of money: {amount!r}") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"an amount of money must be finite and >= 0, got {amount!r}")
    micros = value * MICRO
    if micros != micros.to_integral_value():
        raise ValueError(f"{amount!r} has more than 6 decimal places")
    return int(micros)


def format_money(micros: float) -> str:
    return f"{Decimal(int(micros)) / MICRO:.6f}".rstrip("0").rstrip(".")
