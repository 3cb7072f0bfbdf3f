"""The config file's settings sections (pydantic): the policy's constants, the gateway's
limits and keys, and where the ledger lives (`policy`, `gateway`, `state`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tokenpools.model.identity_schema import JwtSpec, TrustedHeaderSpec
from tokenpools.model.keys import is_key_hash
from tokenpools.model.policy import Policy
from tokenpools.model.schema_base import Fraction, NonNeg, Pos, Strict
from tokenpools.model.service_class import ServiceClass


class PolicySpec(Strict):
    classWeights: dict[ServiceClass, NonNeg] = {}
    alphaSlo: NonNeg = 2.0
    alphaBurst: NonNeg = 1.0
    alphaDebt: NonNeg = 4.0
    gammaDebt: Fraction = 0.7
    gammaBurst: Fraction = 0.7
    updatePeriodS: Pos = 5.0
    burstWindowS: Pos = 60.0
    headroom: Fraction = 0.25
    contentionWindowS: Pos = 0.5
    priorityMargin: NonNeg = 0.2
    overcommit: Annotated[float, Field(ge=0, le=1)] = 0.1
    backfillWindowS: NonNeg = 40.0
    preemptibleCompletionTarget: Annotated[float, Field(gt=0, lt=1)] = 0.8
    elasticOversubscription: Annotated[float, Field(ge=1)] = 1.5
    defaultMaxTokens: Annotated[int, Field(ge=1)] = 256
    leaseTtlS: Pos = 600.0
    retryAfterMinS: Pos = 1.0
    retryAfterMaxS: Pos = 60.0
    retryAfterJitter: Fraction = 0.2
    suspend: bool = True
    suspendDeadlineS: dict[ServiceClass, Pos] = {}

    @model_validator(mode="after")
    def _check(self) -> PolicySpec:
        if self.retryAfterMinS > self.retryAfterMaxS:
            raise ValueError("retryAfterMinS must be <= retryAfterMaxS")
        return self

    def to_policy(self) -> Policy:
        weights = Policy().class_weights | dict(self.classWeights)
        return Policy(
            class_weights=weights,
            alpha_slo=self.alphaSlo,
            alpha_burst=self.alphaBurst,
            alpha_debt=self.alphaDebt,
            gamma_debt=self.gammaDebt,
            gamma_burst=self.gammaBurst,
            update_period_s=self.updatePeriodS,
            burst_window_s=self.burstWindowS,
            headroom=self.headroom,
            contention_window_s=self.contentionWindowS,
            priority_margin=self.priorityMargin,
            overcommit=self.overcommit,
            backfill_window_s=self.backfillWindowS,
            preemptible_completion_target=self.preemptibleCompletionTarget,
            elastic_oversubscription=self.elasticOversubscription,
            default_max_tokens=self.defaultMaxTokens,
            lease_ttl_s=self.leaseTtlS,
            retry_after_min_s=self.retryAfterMinS,
            retry_after_max_s=self.retryAfterMaxS,
            retry_after_jitter=self.retryAfterJitter,
            suspend=self.suspend,
            suspend_deadline_s=Policy().suspend_deadline_s | dict(self.suspendDeadlineS),
        )


class GatewaySpec(Strict):
    adminKeys: list[str] = []  # sha256 hashes, as apiKeys
    maxBodyBytes: Annotated[int, Field(gt=0)] = 1 << 20
    charsPerToken: Pos = 4.0  # prompt-token estimate without a tokenizer
    maxSequences: Annotated[int, Field(ge=1, le=128)] = 8  # the most `n` / `best_of` asks for
    tokenizeTimeoutMs: Annotated[float, Field(gt=0, le=10000)] = 500.0  # `tokenizer: backend`
    jwt: JwtSpec | None = None  # bearer JWTs from an identity provider (docs/identity.md)
    trustedHeader: TrustedHeaderSpec | None = None  # the tenant named by an auth proxy

    @model_validator(mode="after")
    def _check(self) -> GatewaySpec:
        for key in self.adminKeys:
            if not is_key_hash(key):
                raise ValueError("adminKeys holds sha256 hashes only (`tokenpools hash-key`)")
        return self


REDIS_URL = r"^(rediss?(\+cluster)?://\S+|redis\+sentinel://[^/\s]+/[^/\s]+(/\d+)?)$"


class StateSpec(Strict):
    """Where the ledger lives: this process (memory) or a Redis shared by gateway replicas."""

    backend: Literal["memory", "redis"] = "memory"
    # one server (redis://, rediss://), a Redis Cluster (redis+cluster://host:port,host:port) or
    # a master behind Sentinel (redis+sentinel://host:port,host:port/service[/db])
    url: Annotated[str, Field(pattern=REDIS_URL)] = "redis://127.0.0.1:6379/0"
    keyPrefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]+$")] = "tokenpools"
    timeoutMs: Annotated[float, Field(gt=0, le=10000)] = 250.0
    retryIntervalS: Pos = 0.25
    fallbackFraction: Annotated[float, Field(ge=0, le=1)] = 0.5
    replicaTimeoutS: Pos = 10.0
