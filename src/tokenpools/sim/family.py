"""A generated family of scenarios for one question: does the preemptible work a pool admits
also complete, whatever the pool and its other tenants look like, without costing the
protected tenants their SLO?

Scenario `index` is drawn from its own seeded random source, so the family is the same on
every machine and a failing member can be rerun alone (`tokenpools simulate` on the YAML that
`family_scenario(i).model_dump()` gives). Each member has 1–4 replicas of the paper's profile;
one or two protected tenants (dedicated, guaranteed) sending Poisson or bursty (gamma) arrivals
at 40–100 % of their baselines, some bursting above it for a phase; up to two elastic tenants;
a closed-loop spot backlog (most members) and a closed-loop preemptible backlog, each with
short or long requests; and in half of them a capacity drop (a replica lost, or every replica
losing part of its slots), sometimes restored. Workload and capacity change only at phase
edges, so every phase is one regime.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tokenpools.model.service_class import PROTECTED
from tokenpools.sim.scenario import Scenario

PHASE_S = 30.0
PHASES = 4
PER_REPLICA_SLOTS = 16
PROFILE = "paper-dgx-spark-qwen3-8b"
POOL = "qwen3-8b"

# (prompt, output) token ranges of the backlogs' request shapes
SHORT = ((32, 128), (32, 128))
LONG = ((128, 512), (256, 512))


@dataclass(frozen=True, slots=True)
class ProtectedPhase:
    """A protected tenant in one phase, and whether the platform promises it its SLO there:
    its offered load is within its baseline and the capacity left holds every protected
    baseline."""

    tenant: str
    phase: str
    slo_ttft_s: float
    within_baseline: bool


def family_scenario(index: int) -> Scenario:
    rng = random.Random(f"tokenpools/preemptible-family/{index}")
    replicas = rng.randint(1, 4)
    slots = PER_REPLICA_SLOTS * replicas
    entitlements: list[dict[str, Any]] = []
    tenants: list[dict[str, Any]] = []

    classes = rng.choice([["guaranteed"], ["dedicated"], ["dedicated", "guaranteed"]])
    protected_share = rng.uniform(0.25, 0.55)
    for cls in classes:
        baseline = max(2, round(slots * protected_share / len(classes)))
        slo = rng.choice([1.0, 1.5])
        name = "prod" if cls == "dedicated" else "api"
        entitlements.append(entitlement_entry(name, cls, baseline, slo))
        load = rng.uniform(0.4, 1.0)
        bursty = rng.random() < 0.5
        changes = []
        if rng.random() < 0.4:  # a burst above the baseline for one phase
            phase = rng.randint(1, PHASES - 2)
            factor = rng.uniform(1.5, 2.5)
            changes = [
                {"at_s": phase * PHASE_S, "rate_factor": factor},
                {"at_s": (phase + 1) * PHASE_S, "rate_factor": 1 / factor},
            ]
        arrivals = {"kind": "gamma", "cv": round(rng.uniform(1.5, 3.0), 2)} if bursty else {}
        tenants.append(
            {
                "name": name,
                "slo_ttft_s": slo,
                "retry": {"max_tries": 5},
                "workload": {
                    "arrivals": {"kind": "poisson", **arrivals, "slots": round(baseline * load, 2)},
                    "prompt": {"kind": "uniform", "low": 32, "high": 256},
                    "output": {"kind": "uniform", "low": 32, "high": 128},
                },
                "changes": changes,
            }
        )

    for i in range(rng.choice([0, 1, 1, 2])):
        name = f"assist{i}"
        baseline = max(2, round(slots * rng.uniform(0.1, 0.2)))
        entitlements.append(entitlement_entry(name, "elastic", baseline, 3.0))
        tenants.append(
            {
                "name": name,
                "retry": {"max_tries": 5},
                "workload": {
                    "arrivals": {
                        "kind": "poisson",
                        "slots": round(baseline * rng.uniform(0.5, 1.2), 2),
                    },
                    "prompt": {"kind": "uniform", "low": 64, "high": 512},
                    "output": {"kind": "uniform", "low": 32, "high": 256},
                },
            }
        )

    if rng.random() < 0.7:
        entitlements.append(entitlement_entry("scrape", "spot", 0, 30.0))
        tenants.append(backlog_entry("scrape", slots * rng.uniform(0.25, 1.0), rng, max_tries=50))
    entitlements.append(
        {"name": "batch", "tenantId": "batch", "pool": POOL, "serviceClass": "preemptible"}
    )
    tenants.append(backlog_entry("batch", slots * rng.uniform(0.5, 1.5), rng, max_tries=1000))

    capacity = []
    if rng.random() < 0.5:
        drop_at = rng.choice([1, 2]) * PHASE_S
        fraction = (replicas - 1) / replicas if replicas > 1 and rng.random() < 0.5 else 0.5
        capacity.append({"at_s": drop_at, "fraction": round(max(fraction, 0.5), 4)})
        if rng.random() < 0.5:
            capacity.append({"at_s": drop_at + PHASE_S, "fraction": 1.0})

    return generated_scenario(
        f"preemptible-family-{index}",
        "generated by tokenpools.sim.family",
        replicas,
        entitlements,
        tenants,
        capacity,
    )


def generated_scenario(
    name: str,
    description: str,
    replicas: int,
    entitlements: list[dict[str, Any]],
    tenants: list[dict[str, Any]],
    capacity: list[dict[str, Any]],
) -> Scenario:
    """A generated family's member: one pool of `replicas` on the family's engine, the
    family's phases, and what the generator drew."""
    return Scenario.model_validate(
        {
            "name": name,
            "description": description,
            "duration_s": PHASE_S * PHASES,
            "seed": 1,
            "engine": {"profile": PROFILE, "replicas": replicas},
            "tokenpools": {
                "policy": {"headroom": 0.25, "overcommit": 0.1, "updatePeriodS": 5},
                "pools": [
                    {
                        "name": POOL,
                        "model": "Qwen3-8B",
                        "replicas": replicas,
                        "perReplica": {
                            "tokensPerSecond": 480,
                            "kvTokens": 65536,
                            "concurrency": PER_REPLICA_SLOTS,
                        },
                        "tokenWeights": {"input": 0.25, "output": 1},
                    }
                ],
                "entitlements": entitlements,
            },
            "tenants": tenants,
            "phases": [
                {"name": f"p{i}", "start_s": i * PHASE_S, "end_s": (i + 1) * PHASE_S}
                for i in range(PHASES)
            ],
            "capacity": capacity,
        }
    )


def entitlement_entry(name: str, cls: str, concurrency: int, slo_s: float) -> dict[str, Any]:
    ent: dict[str, Any] = {"name": name, "tenantId": name, "pool": POOL, "serviceClass": cls}
    ent["sloTargetMs"] = round(slo_s * 1000)
    if concurrency:
        ent["concurrency"] = concurrency
    return ent


def backlog_entry(name: str, clients: float, rng: random.Random, max_tries: int) -> dict[str, Any]:
    """A closed-loop backlog: clients that send their next request as soon as one ends."""
    (p_lo, p_hi), (o_lo, o_hi) = rng.choice([SHORT, LONG])
    return {
        "name": name,
        "retry": {"max_tries": max_tries},
        "workload": {
            "arrivals": {"kind": "closed", "clients": max(1, round(clients))},
            "prompt": {"kind": "uniform", "low": p_lo, "high": p_hi},
            "output": {"kind": "uniform", "low": o_lo, "high": o_hi},
        },
    }


def protected_phases(scenario: Scenario) -> list[ProtectedPhase]:
    """Every (protected tenant, phase) of a family member, and whether its SLO is promised."""
    config = scenario.config()
    pool = next(iter(config.pools.values()))
    protected = {
        t.name: config.entitlements[t.entitlement or t.name]
        for t in scenario.tenants
        if config.entitlements[t.entitlement or t.name].service_class in PROTECTED
    }
    held = sum(e.baseline.concurrency for e in protected.values())
    out = []
    for phase in scenario.phases:
        fraction = 1.0
        for event in scenario.capacity:
            if event.at_s <= phase.start_s:
                fraction = event.fraction
        fits = held <= pool.capacity.concurrency * fraction
        for tenant in scenario.tenants:
            ent = protected.get(tenant.name)
            if ent is None:
                continue
            factor = 1.0
            for change in tenant.changes:
                if change.at_s <= phase.start_s:
                    factor *= change.rate_factor or 1.0
            offered = (tenant.workload.arrivals.slots or 0.0) * factor
            slo = tenant.slo_ttft_s or (ent.slo_target_ms or 0) / 1000
            within = fits and offered <= ent.baseline.concurrency * (1 + 1e-9)
            out.append(ProtectedPhase(tenant.name, phase.name, slo, within))
    return out
