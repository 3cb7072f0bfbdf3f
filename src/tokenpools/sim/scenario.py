"""Scenario files (the shipped ones: tokenpools/scenarios/*.yaml): who sends what, when,
against which engine and config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tokenpools.model.config import Config, ConfigError, parse_config
from tokenpools.model.pool import SchedulingPolicy

NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Pos = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Lengths(_Strict):
    """A token-length distribution: fixed, uniform, lognormal or drawn from a list."""

    kind: Literal["fixed", "uniform", "lognormal", "list"] = "fixed"
    value: int | None = Field(default=None, ge=1)
    low: int | None = Field(default=None, ge=1)
    high: int | None = Field(default=None, ge=1)
    mean: Pos | None = None  # lognormal: mean of the distribution, in tokens
    sigma: NonNeg | None = None
    values: list[Annotated[int, Field(ge=1)]] | None = None
    max: int | None = Field(default=None, ge=1)  # lognormal cap

    @model_validator(mode="after")
    def _check(self) -> Lengths:
        need = {
            "fixed": ("value",),
            "uniform": ("low", "high"),
            "lognormal": ("mean", "sigma"),
            "list": ("values",),
        }[self.kind]
        missing = [n for n in need if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{self.kind} lengths need {', '.join(missing)}")
        if self.kind == "uniform" and (self.low or 0) > (self.high or 0):
            raise ValueError("uniform lengths need low <= high")
        return self

    def mean_value(self) -> float:
        if self.kind == "fixed":
            return float(self.value or 0)
        if self.kind == "uniform":
            return ((self.low or 0) + (self.high or 0)) / 2
        if self.kind == "lognormal":
            return float(self.mean or 0)
        return sum(self.values or []) / len(self.values or [1])


class Arrivals(_Strict):
    """Open loop (poisson, gamma) at `rate` req/s, or at `slots` of demand (rate = slots /
    the engine's nominal service time); or closed loop with `clients` that each wait for their
    answer, then `think_s`."""

    kind: Literal["poisson", "gamma", "closed"] = "poisson"
    rate: Pos | None = None
    slots: Pos | None = None
    cv: Pos = 1.0  # gamma: coefficient of variation of the gaps (1 = Poisson)
    clients: int | None = Field(default=None, ge=1)
    think_s: NonNeg = 0.0

    @model_validator(mode="after")
    def _check(self) -> Arrivals:
        if self.kind == "closed":
            if self.clients is None:
                raise ValueError("closed-loop arrivals need clients")
        elif (self.rate is None) == (self.slots is None):
            raise ValueError(f"{self.kind} arrivals need exactly one of rate or slots")
        return self


class Retry(_Strict):
    """What a client does after a 429: wait Retry-After (± jitter) or, without one, back off
    exponentially as the openai client does (0.5 s doubling to 8 s); give up after max_tries."""

    max_tries: int = Field(default=3, ge=1)
    jitter: Annotated[float, Field(ge=0, lt=1)] = 0.2
    honour_retry_after: bool = True


class Workload(_Strict):
    arrivals: Arrivals
    prompt: Lengths
    output: Lengths
    max_tokens: int | None = Field(default=None, ge=1)  # sent as max_tokens; None: the output
    start_s: NonNeg = 0.0  # the tenant joins
    end_s: NonNeg | None = None  # the tenant leaves (stops sending new requests)


class Limits(_Strict):
    """Per-tenant limits for the baseline policies; derived from the entitlement if omitted."""

    rpm: Pos | None = None
    tpm: Pos | None = None
    concurrency: Annotated[int, Field(ge=0)] | None = None


class Tenant(_Strict):
    name: str
    entitlement: str | None = None  # defaults to the tenant's name
    # tokenpools sends each request to every entitlement of the entitlement's tenantId in its
    # pool, as layers (the first with room admits it), as the gateway does for one tenant's key;
    # the baselines know only `entitlement`
    layered: bool = False
    workload: Workload
    retry: Retry = Retry()
    slo_ttft_s: Pos | None = None  # goodput threshold; default: the entitlement's sloTargetMs
    slo_tpot_s: Pos | None = None
    limits: Limits = Limits()
    sheddable: bool | None = None  # priority-shed; default: spot and preemptible are sheddable
    # The entitlement exists only while the tenant takes part: created when it joins
    # (workload.start_s), expired when it leaves (workload.end_s) — its requests in flight
    # finish. The paper's "guaranteed-c joins at 30 s, leaves at 60 s".
    entitlement_while_active: bool = False
    # With entitlement_while_active: the entitlement is created this long before the tenant's
    # first request (a tenant is provisioned before it sends traffic; the autoscaler's lead).
    entitlement_lead_s: NonNeg = 0.0
    # A change of workload from a time on (a reasoning burst, a rate change).
    changes: list[WorkloadChange] = []


class WorkloadChange(_Strict):
    at_s: NonNeg
    rate_factor: Pos | None = None
    output: Lengths | None = None
    prompt: Lengths | None = None
    max_tokens: int | None = Field(default=None, ge=1)


class Phase(_Strict):
    name: str
    start_s: NonNeg
    end_s: Pos


class CapacityEvent(_Strict):
    """At `at_s`, every replica's capacity becomes `fraction` of its profile (KV and slots),
    e.g. 0.5 for a replica that lost half its GPUs."""

    at_s: NonNeg
    fraction: Annotated[float, Field(gt=0, le=1)]


class Restart(_Strict):
    """At `at_s` the gateway restarts on an empty store: the requests in flight finish on the
    engines, and the new process knows none of them, nor anything it measured."""

    at_s: NonNeg
    # empty: the memory store, lost with the process; kept: a shared store (Redis) that
    # outlives it, with the leases in flight and everything measured
    store: Literal["empty", "kept"] = "empty"


class AutoscalingSpec(_Strict):
    """The pool's autoscaler: every `interval_s` the policy's own arithmetic (tokenpools: the
    core's desired replicas) is compared with the replicas provisioned; more are asked for once
    the need has stayed above for `scale_up_delay_s`, and serve `cold_start_s` later (costing
    replica-seconds from the ask); one is drained once the need has stayed below the serving
    count for `scale_down_delay_s`. Within the pool's minReplicas..maxReplicas.
    `enabled: false` keeps the replicas static (the static-peak comparison run)."""

    enabled: bool = True
    interval_s: Pos = 5.0
    cold_start_s: NonNeg = 60.0
    scale_up_delay_s: NonNeg = 15.0
    scale_down_delay_s: NonNeg = 120.0


class LlmdSpec(_Strict):
    """How llm-d's flow control is configured for the `llm-d` and `tokenpools+llm-d` policies
    (sim/llmd_flow.py) and its legacy admission for `llm-d-legacy` (sim/llmd_legacy.py).
    Defaults are llm-d's own (pkg/epp/flowcontrol and its plugins), except where noted:
    fairness `program-aware` and in-flight eviction on, which a platform team comparing it with
    tokenpools would turn on (llm-d ships global-strict and eviction off)."""

    # service class → band (InferenceObjective priority); default: model/objectives.PRIORITY
    priorities: dict[str, int] | None = None
    fairness: Literal["program-aware", "round-robin", "global-strict"] = "program-aware"
    las_weight_service: NonNeg = 0.8
    las_weight_head_wait: NonNeg = 0.2
    las_half_life_s: NonNeg = 60.0  # 0: no decay
    detector: Literal["utilization", "concurrency"] = "utilization"
    queue_depth_threshold: Annotated[int, Field(gt=0)] = 5
    kv_cache_util_threshold: Annotated[float, Field(gt=0, le=1)] = 0.8
    # concurrency detector: requests in flight per endpoint at saturation (llm-d: 100); None:
    # the engine's max_num_seqs, what an operator would set for these engines
    max_concurrency: Annotated[int, Field(gt=0)] | None = None
    usage_limit: Literal["static", "priority-holdback", "soft-reflective-ceiling"] = "static"
    threshold: Annotated[float, Field(gt=0, le=1)] = 1.0  # static
    min_ceiling: Annotated[float, Field(ge=0, lt=1)] = 0.4  # priority-holdback (required there)
    max_ceiling: Annotated[float, Field(gt=0, le=1)] = 1.0
    domain: Literal["rank", "value"] = "rank"
    request_ttl_s: NonNeg = 60.0  # 0: no queue time-out
    band_max_requests: Annotated[int, Field(gt=0)] = 5000
    band_max_bytes: Annotated[int, Field(gt=0)] = 1_000_000_000
    eviction: bool = True
    max_revocations: Annotated[int, Field(gt=0)] = 2
    # None: derived from the detector as llm-d's runner does (sim/llmd_parts.py)
    confirmation_grace_s: NonNeg | None = None
    # llm-d's propagatePriority (openai parser, off by default): the router writes the
    # request's priority into the body for the engine, negated for vLLM (lower runs first)
    propagate_priority: bool = False

    @model_validator(mode="after")
    def _check(self) -> LlmdSpec:
        if self.usage_limit == "priority-holdback" and self.min_ceiling >= self.max_ceiling:
            raise ValueError("llmd: min_ceiling must be below max_ceiling")
        return self


class EngineSpec(_Strict):
    profile: str
    replicas: int = Field(default=1, ge=1)
    scheduling_policy: SchedulingPolicy = "fcfs"  # vLLM's --scheduling-policy


class Scenario(_Strict):
    name: str
    description: str = ""
    duration_s: Pos
    seed: int = 1
    engine: EngineSpec
    tokenpools: dict[str, Any]  # a tokenpools config: policy, pools (one), entitlements
    tenants: list[Tenant]
    phases: list[Phase]
    capacity: list[CapacityEvent] = []
    restarts: list[Restart] = []
    autoscaling: AutoscalingSpec | None = None
    llmd: LlmdSpec = LlmdSpec()
    sample_interval_s: Pos = 0.5

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        for phase in self.phases:
            if phase.end_s <= phase.start_s:
                raise ValueError(f"phase {phase.name!r} ends before it starts")
        return self

    def config(self) -> Config:
        """The tokenpools config, its pool scheduling as the scenario's engines do (a pool that
        says otherwise is an error: the gateway would send priorities the engine ignores)."""
        pools = self.tokenpools.get("pools")
        if isinstance(pools, list) and len(pools) == 1 and isinstance(pools[0], dict):
            said = pools[0].get("schedulingPolicy", self.engine.scheduling_policy)
            if said != self.engine.scheduling_policy:
                raise ConfigError(
                    f"scenario {self.name!r}: the pool's schedulingPolicy {said!r} is not the "
                    f"engine's scheduling_policy {self.engine.scheduling_policy!r}"
                )
            pool = {**pools[0], "schedulingPolicy": self.engine.scheduling_policy}
            data = {**self.tokenpools, "pools": [pool]}
        else:
            data = self.tokenpools
        try:
            config = parse_config(data)
        except ConfigError as exc:
            raise ConfigError(f"scenario {self.name!r}, tokenpools config:\n{exc}") from None
        if len(config.pools) != 1:
            raise ConfigError(f"scenario {self.name!r}: the tokenpools config needs one pool")
        for tenant in self.tenants:
            if (tenant.entitlement or tenant.name) not in config.entitlements:
                raise ConfigError(
                    f"scenario {self.name!r}: tenant {tenant.name!r} has no entitlement "
                    f"{tenant.entitlement or tenant.name!r}"
                )
        return config

    def static_peak(self) -> Scenario:
        """The same scenario on the pool's maxReplicas from the start, autoscaling off."""
        pool = self.tokenpools["pools"][0]
        peak = int(pool.get("maxReplicas", pool.get("replicas", 1)))
        config = {**self.tokenpools, "pools": [{**pool, "replicas": peak}]}
        spec = self.autoscaling or AutoscalingSpec()
        return self.model_copy(
            update={
                "engine": self.engine.model_copy(update={"replicas": peak}),
                "tokenpools": config,
                "autoscaling": spec.model_copy(update={"enabled": False}),
            }
        )

    def on_engines(self, scheduling: str) -> Scenario:
        """The same scenario on engines that schedule by `scheduling` (vLLM's
        --scheduling-policy), every policy using it as it would: tokenpools' pool follows the
        engine (config()), and with priority engines llm-d passes its priority through."""
        engine = EngineSpec.model_validate(
            {**self.engine.model_dump(), "scheduling_policy": scheduling}
        )
        pools = [{**p, "schedulingPolicy": scheduling} for p in self.tokenpools.get("pools", [])]
        llmd = self.llmd.model_copy(update={"propagate_priority": scheduling == "priority"})
        return self.model_copy(
            update={
                "engine": engine,
                "tokenpools": {**self.tokenpools, "pools": pools},
                "llmd": llmd,
            }
        )


Tenant.model_rebuild()


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
        return Scenario.model_validate(data)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except ValidationError as exc:
        raise ConfigError(f"{path}: invalid scenario\n{exc}") from None
