"""Budgets in the simulator, over a generated family of scenarios: a tenant with a budget
smaller than its demand is stopped at it (refused with insufficient_quota, never charged more
than the limit, in any measure and window), and the other tenants complete what they complete in
the same scenario without the budget (within 5 %: their requests meet the pool at other
instants, and their own limits refuse a different few). The shipped `beyond-budget` scenario shows
the same."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tokenpools.control.budgets import budget_status
from tokenpools.shipped import scenario_path
from tokenpools.sim.scenario import Scenario, load_scenario
from tokenpools.sim.simulator import Simulation

DURATION = 40


def family(seed: int) -> dict[str, Any]:
    """Two or three tenants of random classes and loads; `capped` has a budget in a random
    measure and window of 20-60 % of what it will ask for."""
    rng = random.Random(seed)
    tenants = ["capped", "t1", "t2"][: rng.choice([2, 3])]
    classes = ["elastic", "guaranteed", "spot"]
    ents = [
        {"name": t, "tenantId": t, "pool": "p", "serviceClass": rng.choice(classes),
         "concurrency": rng.choice([4, 8])}
        for t in tenants
    ]  # fmt: skip
    shapes = {
        t: (rng.choice([2, 4, 8]), rng.choice([256, 1024]), rng.choice([64, 256])) for t in tenants
    }
    rate, prompt, output = shapes["capped"]
    sent = rate * (DURATION - 10)
    measure = rng.choice(["tokens", "input", "output", "cost"])
    asked = sent * {"input": prompt, "output": output}.get(measure, prompt + output)
    limit = int(asked * rng.uniform(0.2, 0.6))
    budget = {"name": "cap", "tenant": "capped", "measure": measure,
              "limit": f"{limit / 1e6:.6f}" if measure == "cost" else limit,
              "window": rng.choice(["lifetime", "hour", "day"])}  # fmt: skip

    def workload(t: str) -> dict[str, Any]:
        rate, prompt, output = shapes[t]
        return {
            "arrivals": {"kind": "poisson", "rate": rate},
            "prompt": {"kind": "lognormal", "mean": prompt, "sigma": 0.5, "max": 4096},
            "output": {"kind": "lognormal", "mean": output, "sigma": 0.5, "max": 1024},
            "end_s": DURATION - 10,
        }

    return {
        "name": f"budget-{seed}", "duration_s": DURATION, "seed": seed,
        "engine": {"profile": "h100-llama3.1-8b", "replicas": 1},
        "tokenpools": {
            "pools": [{"name": "p", "model": "Llama-3.1-8B",
                       "prices": {"inputPerMillion": 1, "outputPerMillion": 1},
                       "perReplica": {"tokensPerSecond": 60000, "kvTokens": 440000,
                                      "concurrency": 64}}],
            "entitlements": ents,
            "budgets": [budget],
        },
        "tenants": [{"name": t, "retry": {"max_tries": 3}, "workload": workload(t)}
                    for t in tenants],
        "phases": [{"name": "all", "start_s": 0, "end_s": DURATION}],
    }  # fmt: skip


def completed(result: Any, tenant: str) -> int:
    return sum(1 for a in result.attempts if a.outcome == "completed" and a.job.tenant == tenant)


@pytest.mark.parametrize("seed", range(12))
def test_a_tenant_is_stopped_at_its_budget_and_the_others_are_not(seed: int) -> None:
    data = family(seed)
    sim = Simulation(Scenario.model_validate(data), "tokenpools")
    result = sim.run()
    (status,) = budget_status(sim.policy.core, DURATION)  # type: ignore[attr-defined]
    assert status["held"] == 0 and status["used"] <= status["limit"]
    refused = [a for a in result.attempts if a.reason == "insufficient_quota"]
    assert refused and {a.job.tenant for a in refused} == {"capped"}
    without = {**data, "tokenpools": {**data["tokenpools"], "budgets": []}}
    free = Simulation(Scenario.model_validate(without), "tokenpools").run()
    assert completed(result, "capped") < completed(free, "capped")
    for tenant in (t["name"] for t in data["tenants"] if t["name"] != "capped"):
        assert completed(result, tenant) >= 0.95 * completed(free, tenant), tenant


def test_the_shipped_budget_scenario_stops_research_alone() -> None:
    scenario = load_scenario(scenario_path("beyond-budget"))
    sim = Simulation(scenario, "tokenpools")
    result = sim.run()
    (status,) = budget_status(sim.policy.core, scenario.duration_s)  # type: ignore[attr-defined]
    assert status["used"] <= 1_500_000 and status["exhausted"]
    free = Simulation(scenario, "none").run()
    assert completed(result, "research") < 0.8 * completed(free, "research")
    for tenant in ("chat", "docs"):
        assert completed(result, tenant) >= completed(free, tenant) * 0.98
