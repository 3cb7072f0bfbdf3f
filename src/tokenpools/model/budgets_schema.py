"""The config file's budgets, prices and usage ledger (model/budgets.py), as pydantic checks
them. Money is written in currency units, as a string or a number ("0.50"), and kept exact."""

from __future__ import annotations

import os
import zoneinfo
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tokenpools.model.budgets import (
    Budget,
    Measure,
    Period,
    Prices,
    Scope,
    UsageSettings,
    Webhook,
    micro_units,
)
from tokenpools.model.schema_base import Pos, Strict

Money = str | float | int
Name = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]


class PricesSpec(Strict):
    """Currency units per million tokens."""

    inputPerMillion: Money = 0
    outputPerMillion: Money = 0
    cachedInputPerMillion: Money | None = None  # unset: cached input costs as input

    @field_validator("inputPerMillion", "outputPerMillion", "cachedInputPerMillion")
    @classmethod
    def _amount(cls, v: Money | None) -> Money | None:
        if v is not None:
            micro_units(v)
        return v

    def to_prices(self) -> Prices:
        cached = (
            self.inputPerMillion
            if self.cachedInputPerMillion is None
            else self.cachedInputPerMillion
        )
        return Prices(
            micro_units(self.inputPerMillion),
            micro_units(self.outputPerMillion),
            micro_units(cached),
        )


class BudgetSpec(Strict):
    name: Name
    # exactly one of the three: who the budget is for
    tenant: Name | None = None
    entitlement: Name | None = None
    key: Annotated[str, Field(max_length=330, pattern=r"^[^\s/]+/\S+$")] | None = (
        None  # "<tenant>/<key label>"
    )
    measure: Literal["input", "output", "tokens", "cost"] = "tokens"
    limit: Money  # tokens; for cost, currency units
    window: Literal["hour", "day", "week", "month", "lifetime"] = "month"
    lowerMaxTokens: bool = False
    notifyAt: list[Annotated[float, Field(gt=0, le=1)]] = [0.8, 1.0]

    @model_validator(mode="after")
    def _check(self) -> BudgetSpec:
        named = [f for f in ("tenant", "entitlement", "key") if getattr(self, f) is not None]
        if len(named) != 1:
            raise ValueError(
                f"budget {self.name!r}: give exactly one of tenant, entitlement or key "
                f"(got {', '.join(named) or 'none'})"
            )
        if self.key is not None and self.key.count("/") != 1:
            raise ValueError(
                f"budget {self.name!r}: key is '<tenant>/<key label>', got {self.key!r}"
            )
        self._limit()
        return self

    def _limit(self) -> int:
        if self.measure == "cost":
            return micro_units(self.limit)
        if isinstance(self.limit, bool) or not (
            isinstance(self.limit, int) or (isinstance(self.limit, str) and self.limit.isdigit())
        ):
            raise ValueError(
                f"budget {self.name!r}: a token limit is a whole number >= 0, got {self.limit!r}"
            )
        limit = int(self.limit)
        if limit < 0:
            raise ValueError(
                f"budget {self.name!r}: a token limit is a whole number >= 0, got {limit}"
            )
        if limit >= 2**53:
            raise ValueError(f"budget {self.name!r}: limit {limit} is too large (< 2**53)")
        return limit

    def to_budget(self) -> Budget:
        scope, target = next(
            (Scope(f), v)
            for f in ("tenant", "entitlement", "key")
            if (v := getattr(self, f)) is not None
        )
        return Budget(
            self.name,
            scope,
            target,
            Measure(self.measure),
            self._limit(),
            Period(self.window),
            self.lowerMaxTokens,
            tuple(sorted(set(self.notifyAt))),
        )


class WebhookSpec(Strict):
    url: Annotated[str, Field(pattern=r"^https?://\S+$")]
    secretEnv: str | None = None  # the environment variable holding the HMAC secret
    timeoutS: Pos = 5.0
    attempts: Annotated[int, Field(ge=1, le=20)] = 5

    def to_webhook(self) -> Webhook:
        secret = b""
        if self.secretEnv is not None:
            value = os.environ.get(self.secretEnv)
            if not value:
                raise ValueError(f"usage.webhook.secretEnv: ${self.secretEnv} is not set")
            secret = value.encode()
        return Webhook(self.url, secret, self.timeoutS, self.attempts)


class UsageSpec(Strict):
    timeZone: str = "UTC"
    database: Annotated[str, Field(pattern=r"^(sqlite:///.+|postgres(ql)?://\S+)$")] | None = None
    flushIntervalS: Pos = 10.0
    # every ledger row carries it and every report reads only its own: deployments sharing a
    # database stay apart
    deployment: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")] = "default"
    databaseTimeoutS: Annotated[float, Field(gt=0, le=300)] = 10.0
    webhook: WebhookSpec | None = None

    @field_validator("timeZone")
    @classmethod
    def _zone(cls, v: str) -> str:
        try:
            zoneinfo.ZoneInfo(v)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {v!r} (an IANA name, e.g. Europe/Berlin)"
            ) from None
        return v

    def to_settings(self) -> UsageSettings:
        webhook = None if self.webhook is None else self.webhook.to_webhook()
        return UsageSettings(
            self.timeZone,
            self.database or "",
            self.flushIntervalS,
            webhook,
            self.deployment,
            self.databaseTimeoutS,
        )
