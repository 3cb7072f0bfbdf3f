"""The admission policies (sim/policy.py is their interface): the decision core, and what
people run today."""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import replace

from tokenpools.control import pipeline
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.control.tenancy import Directory
from tokenpools.model.config import Config
from tokenpools.model.entitlement import Entitlement
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.model.resources import Resources
from tokenpools.model.service_class import ServiceClass
from tokenpools.sim.policy import (
    AdmissionPolicy,
    Cluster,
    Queue,
    Refuse,
    Send,
    SimRequest,
    TenantLimits,
    Verdict,
)
from tokenpools.state.memory import MemoryStore


class NoAdmissionControl(AdmissionPolicy):
    """The paper's baseline: every request goes to the engine queue."""

    name = "none"


class RequestRate(AdmissionPolicy):
    """Per-tenant requests per minute in fixed calendar-minute windows, as LiteLLM's rpm
    limits; its 429s carry no Retry-After."""

    name = "request-rate"

    def __init__(self, limits: dict[str, TenantLimits]) -> None:
        self.limits = limits
        self.window: dict[str, tuple[int, int]] = {}

    def admit(self, req: SimRequest, now: float) -> Verdict:
        minute = int(now // 60)
        start, count = self.window.get(req.tenant, (minute, 0))
        if start != minute:
            count = 0
        if count + 1 > self.limits[req.tenant].rpm:
            return Refuse("rate_limited")
        self.window[req.tenant] = (minute, count + 1)
        return Send()


class TokenRate(AdmissionPolicy):
    """Per-tenant tokens per minute counted after the response, as LiteLLM does: a request is
    admitted while the minute's *completed* tokens are under the limit, so concurrent requests
    all pass before any is counted."""

    name = "token-rate"

    def __init__(self, limits: dict[str, TenantLimits]) -> None:
        self.limits = limits
        self.window: dict[str, tuple[int, float]] = {}

    def _used(self, tenant: str, now: float) -> float:
        minute = int(now // 60)
        start, used = self.window.get(tenant, (minute, 0.0))
        return used if start == minute else 0.0

    def admit(self, req: SimRequest, now: float) -> Verdict:
        if self._used(req.tenant, now) >= self.limits[req.tenant].tpm:
            return Refuse("rate_limited")
        return Send()

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        used = self._used(req.tenant, now) + req.prompt_tokens + output_tokens
        self.window[req.tenant] = (int(now // 60), used)


class StaticConcurrency(AdmissionPolicy):
    """Static per-tenant limits on requests in flight."""

    name = "concurrency"

    def __init__(self, limits: dict[str, TenantLimits]) -> None:
        self.limits = limits
        self.inflight: dict[str, int] = defaultdict(int)

    def admit(self, req: SimRequest, now: float) -> Verdict:
        if self.inflight[req.tenant] >= self.limits[req.tenant].concurrency:
            return Refuse("concurrency_limit")
        self.inflight[req.tenant] += 1
        return Send()

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        self.inflight[req.tenant] -= 1

    def ended_early(self, req: SimRequest, now: float) -> None:
        self.inflight[req.tenant] -= 1


class PriorityShed(AdmissionPolicy):
    """Gateway API Inference Extension style: sheddable traffic (negative priority: spot and
    preemptible by default) is rejected while the engines are saturated — a waiting queue of
    at least `queue_threshold` or KV usage of at least `kv_threshold` (the extension's
    defaults); everything else goes through. No Retry-After."""

    name = "priority-shed"

    def __init__(
        self,
        limits: dict[str, TenantLimits],
        cluster: Cluster,
        queue_threshold: int = 5,
        kv_threshold: float = 0.8,
    ) -> None:
        self.limits, self.cluster = limits, cluster
        self.queue_threshold, self.kv_threshold = queue_threshold, kv_threshold

    def admit(self, req: SimRequest, now: float) -> Verdict:
        saturated = (
            self.cluster.waiting >= self.queue_threshold
            or self.cluster.kv_usage >= self.kv_threshold
        )
        if saturated and self.limits[req.tenant].sheddable:
            return Refuse("shed")
        return Send()


class VirtualTokenCounter(AdmissionPolicy):
    """VTC (Sheng et al., OSDI 2024) as an admission order: requests wait in per-tenant queues
    at the gateway and go to the engines when they have a free slot, the backlogged tenant with
    the smallest counter of weighted tokens first (input 1, output 2); a tenant that becomes
    backlogged is lifted to the smallest counter among the backlogged. Nothing is rejected."""

    name = "vtc"
    holds_requests = True

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0) -> None:
        self.w_in, self.w_out = w_in, w_out
        self.counter: dict[str, float] = defaultdict(float)
        self.queues: dict[str, deque[SimRequest]] = defaultdict(deque)

    def admit(self, req: SimRequest, now: float) -> Verdict:
        queue = self.queues[req.tenant]
        if not queue:
            backlogged = [self.counter[t] for t, q in self.queues.items() if q]
            if backlogged:
                self.counter[req.tenant] = max(self.counter[req.tenant], min(backlogged))
        queue.append(req)
        return Queue()

    def dispatch(self, now: float, free_slots: int) -> list[SimRequest]:
        out = []
        while free_slots > 0:
            backlogged = [t for t, q in self.queues.items() if q]
            if not backlogged:
                break
            tenant = min(backlogged, key=lambda t: (self.counter[t], t))
            req = self.queues[tenant].popleft()
            self.counter[tenant] += self.w_in * req.prompt_tokens
            out.append(req)
            free_slots -= 1
        return out

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        self.counter[req.tenant] += self.w_out * output_tokens


class TokenPools(AdmissionPolicy):
    """The decision core itself, called exactly as the gateway calls it."""

    name = "tokenpools"

    def __init__(
        self,
        config: Config,
        now: float,
        absent: frozenset[str] = frozenset(),
        layered: frozenset[str] = frozenset(),
    ) -> None:
        """`layered`: entitlements whose requests go to all of their tenant's entitlements in
        the pool, in layer order (control/layers.py), as the gateway sends a tenant's."""
        self.config = config
        directory = Directory(config)
        self.layers: dict[str, tuple[str, ...]] = {}
        for name in layered:
            ent = config.entitlements[name]
            self.layers[name] = directory.layers(ent.tenant_id)[ent.pool]
        self.absent = set(absent)  # entitlements not created yet
        self.store = MemoryStore()
        self.core = DecisionCore(self._current(), self.store, now=now)
        self.pool = next(iter(config.pools))
        self.per_replica = config.pools[self.pool].per_replica
        self.replicas = config.pools[self.pool].replicas
        self.capacity_now = self.per_replica  # after capacity events
        self.tenant_of: dict[str, str] = {}  # entitlement → tenant
        # With budgets in the config, requests are charged to them as the gateway charges a
        # tenant's (its key: `sim`, the model: the pool); without, nothing is metered.
        self.accounts = (
            {n: Account(e.tenant_id, "sim", e.pool) for n, e in config.entitlements.items()}
            if config.budgets
            else {}
        )

    def _current(self) -> Config:
        ents = {k: v for k, v in self.config.entitlements.items() if k not in self.absent}
        return replace(self.config, entitlements=ents)

    def join(self, entitlement: str, now: float) -> None:
        self.absent.discard(entitlement)
        self.core.apply_config(self._current(), now)

    def leave(self, entitlement: str, now: float) -> list[str]:
        # Leaving = the entitlement expires now: it stops admitting and stops holding its
        # baseline back at once, while its requests in flight finish and settle normally.
        ent = replace(self.config.entitlements[entitlement], expires_at=now)
        self.config = replace(
            self.config, entitlements=self.config.entitlements | {entitlement: ent}
        )
        return [lease.lease_id for lease in self.core.apply_config(self._current(), now)]

    def admit(self, req: SimRequest, now: float) -> Verdict:
        self.tenant_of[req.entitlement] = req.tenant
        cost = RequestCost(req.prompt_tokens, req.max_tokens, 1, self.accounts.get(req.entitlement))
        names = self.layers.get(req.entitlement, (req.entitlement,))
        decision = pipeline.run(self.core, names, cost, now, req.req_id)
        if isinstance(decision, Admit):
            return Send([lease.lease_id for lease in decision.evict])
        return Refuse(decision.reason.value, decision.retry_after_s)

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        self.core.settle(req.req_id, Usage(req.prompt_tokens, output_tokens), now)

    def ended_early(self, req: SimRequest, now: float) -> None:
        self.core.release(req.req_id, now, refund=False)

    def tick(self, now: float) -> list[str]:
        result = self.core.tick(now)
        return [lease.lease_id for lease in result.expired]

    def capacity(self, fraction: float, throughput_fraction: float, now: float) -> list[str]:
        base = self.per_replica
        per_replica = Resources(
            base.throughput * throughput_fraction,
            base.kv_tokens * fraction,
            base.concurrency * fraction,
        )
        self.capacity_now = per_replica
        change = self.core.set_capacity(self.pool, now, per_replica=per_replica)
        return [lease.lease_id for lease in change.evict]

    def desired_replicas(self, now: float) -> int | None:
        return self.core.desired_replicas(self.pool)

    def set_replicas(self, replicas: int, now: float) -> list[str]:
        self.replicas = replicas
        change = self.core.set_replicas(self.pool, replicas, now)
        return [lease.lease_id for lease in change.evict]

    def restart(self, now: float, store_kept: bool = False) -> None:
        # A new core, told the capacity the old one had been told, on the old store if it is
        # kept; on a new one, the requests in flight settle as unknown leases (a no-op).
        self.store = self.store if store_kept else MemoryStore()
        self.core = DecisionCore(self._current(), self.store, now=now)
        if self.capacity_now != self.per_replica:
            self.core.set_capacity(self.pool, now, per_replica=self.capacity_now)
        if self.replicas != self.config.pools[self.pool].replicas:
            self.core.set_replicas(self.pool, self.replicas, now)

    def scores(self, now: float) -> dict[str, tuple[float, float]]:
        out = {}
        for ent, tenant in self.tenant_of.items():
            if ent in self.absent:
                continue
            scores = self.core.scores(ent, now)
            out[tenant] = (scores.debt, scores.priority)
        return out


POLICIES = (
    "none",
    "request-rate",
    "token-rate",
    "concurrency",
    "priority-shed",
    "vtc",
    "tokenpools",
)


def derive_limits(
    ent: Entitlement, pool_capacity: Resources, mean_cost_tokens: float, sheddable: bool | None
) -> TenantLimits:
    """What an operator of each baseline would configure from the same entitlement: the
    baseline where there is one, else the burst ceiling, else the whole pool."""
    ceiling = ent.burst_ceiling

    def pick(base: float, burst: float | None, pool: float) -> float:
        if base > 0:
            return base
        if burst is not None and math.isfinite(burst):
            return burst
        return pool

    tps = pick(
        ent.baseline.throughput,
        None if ceiling is None else ceiling.throughput,
        pool_capacity.throughput,
    )
    concurrency = pick(
        ent.baseline.concurrency,
        None if ceiling is None else ceiling.concurrency,
        pool_capacity.concurrency,
    )
    if sheddable is None:
        sheddable = ent.service_class in (ServiceClass.SPOT, ServiceClass.PREEMPTIBLE)
    return TenantLimits(
        rpm=tps * 60 / max(1.0, mean_cost_tokens),
        tpm=tps * 60,
        concurrency=max(1, round(concurrency)),
        sheddable=sheddable,
    )


def make_policy(
    name: str,
    config: Config,
    limits: dict[str, TenantLimits],
    cluster: Cluster,
    now: float,
    absent: frozenset[str] = frozenset(),
    layered: frozenset[str] = frozenset(),
) -> AdmissionPolicy:
    factories: dict[str, Callable[[], AdmissionPolicy]] = {
        "none": NoAdmissionControl,
        "request-rate": lambda: RequestRate(limits),
        "token-rate": lambda: TokenRate(limits),
        "concurrency": lambda: StaticConcurrency(limits),
        "priority-shed": lambda: PriorityShed(limits, cluster),
        "vtc": VirtualTokenCounter,
        "tokenpools": lambda: TokenPools(config, now, absent, layered),
    }
    if name not in factories:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return factories[name]()
