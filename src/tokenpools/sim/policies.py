"""The admission policies the simulator runs, by name: tokenpools (sim/tokenpools_policy.py)
and what people run today (sim/baselines.py)."""

from __future__ import annotations

from collections.abc import Callable

from tokenpools.model.config import Config
from tokenpools.sim.baselines import (
    NoAdmissionControl,
    PriorityShed,
    RequestRate,
    StaticConcurrency,
    TokenRate,
    VirtualTokenCounter,
    derive_limits,
)
from tokenpools.sim.policy import AdmissionPolicy, Cluster, TenantLimits
from tokenpools.sim.tokenpools_policy import TokenPools

__all__ = ["POLICIES", "TokenPools", "derive_limits", "make_policy"]


POLICIES = (
    "none",
    "request-rate",
    "token-rate",
    "concurrency",
    "priority-shed",
    "vtc",
    "tokenpools",
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
