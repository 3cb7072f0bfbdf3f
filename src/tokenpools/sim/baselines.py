"""The admission policies people run today, as the simulator compares them with tokenpools
(sim/policy.py is their interface), and the limits an operator of each would configure from
the same entitlements (`derive_limits`)."""

from __future__ import annotations

import math
from collections import defaultdict, deque
from typing import TYPE_CHECKING

from tokenpools.model.entitlement import Entitlement
from tokenpools.model.resources import Resources
from tokenpools.model.service_class import ServiceClass
from tokenpools.sim.llmd_parts import utilization_saturation
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

if TYPE_CHECKING:
    from tokenpools.model.config import Config
    from tokenpools.sim.scenario import Scenario


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
    preemptible by default) is rejected while the engines are saturated — per endpoint the
    larger of waiting / `queue_threshold` and KV use / `kv_threshold`, averaged over the
    endpoints, at least 1.0, as llm-d's legacy admission reads it (its utilisation detector and
    defaults), here without scrape lag; everything else goes through. No Retry-After."""

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
        if not self.limits[req.tenant].sheddable:
            return Send()
        endpoints = self.cluster.endpoints
        if utilization_saturation(endpoints, self.queue_threshold, self.kv_threshold) >= 1.0:
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


def tenant_limits(scenario: Scenario, config: Config) -> dict[str, TenantLimits]:
    """Each tenant's limits for the baselines: what the scenario sets, else derived from its
    entitlement on the scenario's one pool (`derive_limits`)."""
    pool = next(iter(config.pools.values()))
    limits: dict[str, TenantLimits] = {}
    for t in scenario.tenants:
        ent = config.entitlements[t.entitlement or t.name]
        w = t.workload
        mean_cost = w.prompt.mean_value() + w.output.mean_value()
        derived = derive_limits(ent, pool.capacity, mean_cost, t.sheddable)
        limits[t.name] = TenantLimits(
            rpm=t.limits.rpm or derived.rpm,
            tpm=t.limits.tpm or derived.tpm,
            concurrency=(
                derived.concurrency if t.limits.concurrency is None else t.limits.concurrency
            ),
            sheddable=derived.sheddable,
        )
    return limits
