"""The config file's schema (pydantic): what a file, or a custom resource, may say.

Field names follow the paper's CRDs (serviceClass, sloTargetMs, tokensPerSecond, kvCacheGiB,
concurrency). Each section checks itself and builds the frozen dataclasses of model/; the
Kubernetes CRDs are generated from these same classes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field, model_validator

from tokenpools.model.budgets import Prices
from tokenpools.model.budgets_schema import BudgetSpec, PricesSpec, UsageSpec
from tokenpools.model.entitlement import Entitlement
from tokenpools.model.identity_schema import TenantSpec
from tokenpools.model.keys import is_key_hash
from tokenpools.model.pool import Backend, CapacityFeedback, Pool, SchedulingPolicy
from tokenpools.model.profile import BUILTIN_PROFILES, ModelProfile
from tokenpools.model.resources import Resources
from tokenpools.model.schema_base import NonNeg, Pos, Strict
from tokenpools.model.service_class import ServiceClass
from tokenpools.model.settings_schema import GatewaySpec, PolicySpec, StateSpec


class _Quantity(Strict):
    """Resources as written in a file; KV may be given in GiB or in tokens, not both."""

    tokensPerSecond: NonNeg | None = None
    kvCacheGiB: NonNeg | None = None
    kvTokens: NonNeg | None = None
    concurrency: NonNeg | None = None

    @model_validator(mode="after")
    def _one_kv_unit(self) -> _Quantity:
        if self.kvCacheGiB is not None and self.kvTokens is not None:
            raise ValueError("give kvCacheGiB or kvTokens, not both")
        return self

    def resources(self, profile: ModelProfile, default: Resources) -> Resources:
        if self.kvTokens is not None:
            kv = self.kvTokens
        elif self.kvCacheGiB is not None:
            kv = profile.kv_tokens_for_gib(self.kvCacheGiB)
        else:
            kv = default.kv_tokens
        return Resources(
            default.throughput if self.tokensPerSecond is None else self.tokensPerSecond,
            kv,
            default.concurrency if self.concurrency is None else self.concurrency,
        )


class ProfileSpec(Strict):
    name: str
    layers: Annotated[int, Field(gt=0)]
    kvHeads: Annotated[int, Field(gt=0)]
    headDim: Annotated[int, Field(gt=0)]
    bytesPerElement: Pos = 2.0


class BackendSpec(Strict):
    url: Annotated[str, Field(pattern=r"^https?://[^/\s]+(/.*)?$")]
    timeoutS: Pos = 600.0
    model: Annotated[str, Field(min_length=1)] | None = None  # the name the backend serves
    apiKeyEnv: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    apiKeyFile: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_key_source(self) -> BackendSpec:
        if self.apiKeyEnv is not None and self.apiKeyFile is not None:
            raise ValueError("give apiKeyEnv or apiKeyFile, not both")
        return self

    def to_backend(self) -> Backend:
        return Backend(
            self.url.rstrip("/"), self.timeoutS, self.model, self.apiKeyEnv, self.apiKeyFile
        )


class FeedbackSpec(Strict):
    waitingThreshold: NonNeg = 1.0
    kvThreshold: Annotated[float, Field(gt=0, le=1)] = 0.95
    decrease: Annotated[float, Field(gt=0, lt=1)] = 0.1
    increase: Annotated[float, Field(gt=0, le=1)] = 0.05
    minFraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    intervalS: Pos = 2.0

    def to_feedback(self) -> CapacityFeedback:
        return CapacityFeedback(
            self.waitingThreshold,
            self.kvThreshold,
            self.decrease,
            self.increase,
            self.minFraction,
            self.intervalS,
        )


class TokenWeights(Strict):
    input: NonNeg = 1.0
    output: NonNeg = 1.0


class PoolSpec(Strict):
    name: Annotated[str, Field(min_length=1)]
    model: str | ProfileSpec
    replicas: Annotated[int, Field(ge=0)] = 1
    minReplicas: Annotated[int, Field(ge=0)] = 0
    maxReplicas: Annotated[int, Field(ge=0)] | None = None
    perReplica: _Quantity
    sloReferenceMs: Pos | None = None
    tokenWeights: TokenWeights = TokenWeights()
    backends: list[BackendSpec] = []
    servedModels: list[Annotated[str, Field(min_length=1)]] = []
    capacityFeedback: FeedbackSpec | None = None  # shrink capacity when the engines saturate
    # prompt tokens: estimate (characters), backend (the engine's /tokenize), or a tokenizer file
    # (tokenizer.json or a GGUF model, read with the `tokenizer` extra)
    tokenizer: Annotated[str, Field(min_length=1)] = "estimate"
    prices: PricesSpec | None = None  # what tokens cost, for budgets in money and the ledger
    # the engines' --scheduling-policy (vLLM): with "priority" each admitted request carries its
    # class's priority in the body (`priority`, lower first), and a client's own is overwritten
    schedulingPolicy: SchedulingPolicy = "fcfs"
    # the engines continue a chat's final assistant message (vLLM's continue_final_message):
    # a suspended chat request resumes that way; false (llama.cpp's server closes the message)
    # keeps lent chat requests from being suspended
    chatContinuation: bool = True

    @model_validator(mode="after")
    def _check(self) -> PoolSpec:
        if isinstance(self.model, str) and self.model not in BUILTIN_PROFILES:
            known = ", ".join(sorted(BUILTIN_PROFILES))
            raise ValueError(f"model {self.model!r} is not a built-in profile ({known})")
        for field in ("tokensPerSecond", "concurrency"):
            if getattr(self.perReplica, field) is None:
                raise ValueError(f"perReplica.{field} is required")
        if self.perReplica.kvCacheGiB is None and self.perReplica.kvTokens is None:
            raise ValueError("perReplica needs kvCacheGiB or kvTokens")
        top = self.replicas if self.maxReplicas is None else self.maxReplicas
        if not self.minReplicas <= self.replicas <= top:
            raise ValueError(
                f"need minReplicas <= replicas <= maxReplicas, got "
                f"{self.minReplicas} <= {self.replicas} <= {top}"
            )
        return self

    def profile(self) -> ModelProfile:
        if isinstance(self.model, str):
            return BUILTIN_PROFILES[self.model]
        m = self.model
        return ModelProfile(m.name, m.layers, m.kvHeads, m.headDim, m.bytesPerElement)

    def to_pool(self) -> Pool:
        profile = self.profile()
        return Pool(
            name=self.name,
            model=profile,
            per_replica=self.perReplica.resources(profile, Resources()),
            replicas=self.replicas,
            min_replicas=self.minReplicas,
            max_replicas=self.replicas if self.maxReplicas is None else self.maxReplicas,
            slo_reference_ms=self.sloReferenceMs,
            input_token_weight=self.tokenWeights.input,
            output_token_weight=self.tokenWeights.output,
            backends=tuple(b.to_backend() for b in self.backends),
            served_models=tuple(self.servedModels),
            capacity_feedback=None
            if self.capacityFeedback is None
            else self.capacityFeedback.to_feedback(),
            tokenizer=self.tokenizer,
            prices=Prices() if self.prices is None else self.prices.to_prices(),
            scheduling_policy=self.schedulingPolicy,
            chat_continuation=self.chatContinuation,
        )


class EntitlementSpec(Strict):
    name: Annotated[str, Field(min_length=1)]
    tenantId: Annotated[str, Field(min_length=1)]
    pool: str
    serviceClass: ServiceClass
    sloTargetMs: Pos | None = None
    concurrency: NonNeg = 0.0
    # Omitted: the concurrency's share of a replica (r_e slots of a replica's tokens/s and KV).
    tokensPerSecond: NonNeg | None = None
    kvCacheGiB: NonNeg | None = None
    kvTokens: NonNeg | None = None
    burst: _Quantity | None = None
    defaultMaxTokens: Annotated[int, Field(ge=1)] | None = None
    expiresAt: datetime | None = None
    apiKeys: list[str] = []

    @model_validator(mode="after")
    def _check(self) -> EntitlementSpec:
        if self.kvCacheGiB is not None and self.kvTokens is not None:
            raise ValueError("give kvCacheGiB or kvTokens, not both")
        for key in self.apiKeys:
            if not is_key_hash(key):
                raise ValueError(
                    "apiKeys holds sha256 hashes only ('sha256:' + 64 hex digits; "
                    f"make one with `tokenpools hash-key`), got {key[:12]!r}..."
                )
        return self

    def to_entitlement(self, pool: Pool) -> Entitlement:
        quantity = _Quantity(
            tokensPerSecond=self.tokensPerSecond,
            kvCacheGiB=self.kvCacheGiB,
            kvTokens=self.kvTokens,
            concurrency=self.concurrency,
        )
        replica = pool.per_replica
        slots = self.concurrency / replica.concurrency if replica.concurrency > 0 else 0.0
        baseline = quantity.resources(pool.model, replica.scale(slots))
        profile = pool.model
        expires = self.expiresAt
        return Entitlement(
            name=self.name,
            tenant_id=self.tenantId,
            pool=self.pool,
            service_class=self.serviceClass,
            baseline=baseline,
            slo_target_ms=self.sloTargetMs,
            burst_ceiling=None if self.burst is None else self.burst.resources(profile, _UNBOUNDED),
            default_max_tokens=self.defaultMaxTokens,
            expires_at=None if expires is None else expires.timestamp(),
            api_key_hashes=tuple(self.apiKeys),
        )


_UNBOUNDED = Resources(float("inf"), float("inf"), float("inf"))


class ConfigSpec(Strict):
    policy: PolicySpec = PolicySpec()
    gateway: GatewaySpec = GatewaySpec()
    state: StateSpec = StateSpec()
    pools: list[PoolSpec]
    entitlements: list[EntitlementSpec] = []
    tenants: list[TenantSpec] = []  # keys by tenant (docs/identity.md)
    budgets: list[BudgetSpec] = []  # docs/budgets.md
    usage: UsageSpec = UsageSpec()

    @model_validator(mode="after")
    def _cross_check(self) -> ConfigSpec:
        problems: list[str] = []
        problems += _duplicates("pools", [p.name for p in self.pools])
        problems += _duplicates("entitlements", [e.name for e in self.entitlements])
        pools = {p.name for p in self.pools}
        served: dict[str, str] = {}
        for i, pool in enumerate(self.pools):
            for model in pool.servedModels or [pool.name]:
                if model in served:
                    problems.append(
                        f"pools[{i}].servedModels: model {model!r} is also served by pool "
                        f"{served[model]!r}; a model name maps to one pool"
                    )
                served.setdefault(model, pool.name)
        for i, ent in enumerate(self.entitlements):
            if ent.pool not in pools:
                problems.append(
                    f"entitlements[{i}].pool: unknown pool {ent.pool!r} "
                    f"(entitlement {ent.name!r}; pools: {', '.join(sorted(pools)) or 'none'})"
                )
        problems += _duplicates("tenants", [t.id for t in self.tenants], "id")
        problems += _key_problems(self, served)
        problems += _budget_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _duplicates(section: str, names: list[str], field: str = "name") -> list[str]:
    seen: set[str] = set()
    out = []
    for i, name in enumerate(names):
        if name in seen:
            out.append(f"{section}[{i}].{field}: duplicate {field} {name!r}")
        seen.add(name)
    return out


def _key_problems(spec: ConfigSpec, served: dict[str, str]) -> list[str]:
    """A key belongs to one tenant (once), and its models are models some pool serves."""
    problems: list[str] = []
    owner: dict[str, str] = {}

    def claim(key: str, where: str, who: str) -> None:
        if key in owner:
            problems.append(
                f"{where}: key {key[:15]}... is also {owner[key]}; a key belongs to one tenant, "
                "once"
            )
        owner.setdefault(key, who)

    for i, tenant in enumerate(spec.tenants):
        for j, key in enumerate(tenant.keys):
            claim(key.hash, f"tenants[{i}].keys[{j}].hash", f"a key of tenant {tenant.id!r}")
            for model in key.models or []:
                if model not in served:
                    problems.append(
                        f"tenants[{i}].keys[{j}].models: no pool serves model {model!r}"
                    )
    for i, ent in enumerate(spec.entitlements):
        for key_hash in ent.apiKeys:
            claim(key_hash, f"entitlements[{i}].apiKeys", f"the key of entitlement {ent.name!r}")
    return problems


def _budget_problems(spec: ConfigSpec) -> list[str]:
    """A budget names something that exists: a tenant, an entitlement, a tenant's key."""
    problems = _duplicates("budgets", [b.name for b in spec.budgets])
    tenants = {t.id for t in spec.tenants} | {e.tenantId for e in spec.entitlements}
    ents = {e.name for e in spec.entitlements}
    keys = {f"{t.id}/{k.label}" for t in spec.tenants for k in t.to_tenant().keys}
    keys |= {f"{e.tenantId}/{e.name}" for e in spec.entitlements if e.apiKeys}
    for i, b in enumerate(spec.budgets):
        if b.tenant is not None and b.tenant not in tenants:
            problems.append(f"budgets[{i}].tenant: unknown tenant {b.tenant!r}")
        if b.entitlement is not None and b.entitlement not in ents:
            problems.append(f"budgets[{i}].entitlement: unknown entitlement {b.entitlement!r}")
        if b.key is not None and b.key not in keys:
            problems.append(
                f"budgets[{i}].key: no key labelled {b.key!r} ('<tenant>/<label>' of a tenant's "
                "key, or '<tenantId>/<entitlement>' for an entitlement's apiKeys)"
            )
    return problems
