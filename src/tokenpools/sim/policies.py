"""The admission policies the simulator runs, by name: tokenpools (sim/tokenpools_policy.py),
what people run today (sim/baselines.py), llm-d's flow control (sim/llmd_flow.py) and its legacy
admission without it (sim/llmd_legacy.py), and tokenpools in front of llm-d's flow control
(sim/tokenpools_llmd.py)."""

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
from tokenpools.sim.llmd_flow import LlmdFlowControl
from tokenpools.sim.llmd_legacy import LlmdLegacyAdmission
from tokenpools.sim.policy import AdmissionPolicy, Cluster, TenantLimits
from tokenpools.sim.scenario import LlmdSpec
from tokenpools.sim.tokenpools_llmd import TokenPoolsThenLlmd
from tokenpools.sim.tokenpools_policy import TokenPools

__all__ = ["POLICIES", "TokenPools", "derive_limits", "make_policy"]


POLICIES = (
    "none",
    "request-rate",
    "token-rate",
    "concurrency",
    "priority-shed",
    "vtc",
    "llm-d",
    "llm-d-legacy",
    "tokenpools",
    "tokenpools+llm-d",
)


def make_policy(
    name: str,
    config: Config,
    limits: dict[str, TenantLimits],
    *,
    cluster: Cluster,
    now: float,
    absent: frozenset[str] = frozenset(),
    layered: frozenset[str] = frozenset(),
    llmd: LlmdSpec | None = None,
) -> AdmissionPolicy:
    factories: dict[str, Callable[[], AdmissionPolicy]] = {
        "none": NoAdmissionControl,
        "request-rate": lambda: RequestRate(limits),
        "token-rate": lambda: TokenRate(limits),
        "concurrency": lambda: StaticConcurrency(limits),
        "priority-shed": lambda: PriorityShed(limits, cluster),
        "vtc": VirtualTokenCounter,
        "llm-d": lambda: LlmdFlowControl(config, cluster, llmd),
        "llm-d-legacy": lambda: LlmdLegacyAdmission(config, cluster, llmd),
        "tokenpools": lambda: TokenPools(config, now, absent, layered),
        "tokenpools+llm-d": lambda: TokenPoolsThenLlmd(config, now, cluster, llmd, absent, layered),
    }
    if name not in factories:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return factories[name]()
