"""The simulated tokenpools sends what the gateway sends: on engines that schedule by priority,
each admitted request carries its class's engine priority; on fcfs engines, none. The pool's
schedulingPolicy follows the scenario's engine, and a pool that says otherwise is an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tokenpools.cli import Scheduling
from tokenpools.model.config import ConfigError
from tokenpools.model.objectives import engine_priority
from tokenpools.model.pool import SCHEDULING_POLICIES
from tokenpools.model.service_class import ServiceClass
from tokenpools.shipped import SCENARIOS
from tokenpools.sim.experiments import run_experiments
from tokenpools.sim.policy import Send, SimRequest
from tokenpools.sim.scenario import Scenario, load_scenario
from tokenpools.sim.tokenpools_policy import TokenPools


def _scenario(scheduling: str) -> Scenario:
    shipped = load_scenario(SCENARIOS / "paper-exp1.yaml")
    engine = shipped.engine.model_copy(update={"scheduling_policy": scheduling})
    return shipped.model_copy(update={"engine": engine})


def _request(n: int, entitlement: str) -> SimRequest:
    return SimRequest(f"r{n}", entitlement, entitlement, 64, 64, 64, 0.0)


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_each_admitted_request_carries_its_class_priority_on_priority_engines(
    scheduling: str,
) -> None:
    scenario = _scenario(scheduling)
    config = scenario.config()
    assert config.pools["qwen3-8b"].scheduling_policy == scheduling
    policy = TokenPools(config, 0.0)
    for n, (name, klass) in enumerate(
        [("guaranteed-a", ServiceClass.GUARANTEED), ("spot-b", ServiceClass.SPOT)]
    ):
        req = _request(n, name)
        assert isinstance(policy.admit(req, 0.0), Send)
        want = engine_priority(klass) if scheduling == "priority" else 0
        assert req.priority == want
    assert engine_priority(ServiceClass.GUARANTEED) < engine_priority(ServiceClass.SPOT)


def test_a_pool_that_schedules_otherwise_than_the_engine_is_refused() -> None:
    scenario = _scenario("fcfs")
    pool = {**scenario.tokenpools["pools"][0], "schedulingPolicy": "priority"}
    mismatched = scenario.model_copy(
        update={"tokenpools": {**scenario.tokenpools, "pools": [pool]}}
    )
    with pytest.raises(ConfigError, match="schedulingPolicy 'priority'"):
        mismatched.config()


def test_on_engines_refuses_a_scheduling_policy_vllm_has_not() -> None:
    with pytest.raises(ValidationError, match="scheduling_policy"):
        _scenario("fcfs").on_engines("lottery")


def test_experiments_run_on_both_engine_schedulings_into_one_report(tmp_path: Path) -> None:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    short = _scenario("fcfs").model_copy(
        update={"duration_s": 6.0, "phases": _scenario("fcfs").phases[:1]}
    )
    phase = short.phases[0].model_copy(update={"end_s": 6.0})
    short = short.model_copy(update={"phases": [phase], "name": "short"})
    (folder / "short.yaml").write_text(yaml.safe_dump(short.model_dump(mode="json")))
    out = tmp_path / "out"
    index = run_experiments(folder, out, ["none", "tokenpools"], family_members=0)
    fcfs = json.loads((out / "short" / "summary.json").read_text())
    by_priority = json.loads((out / "priority-engines" / "short" / "summary.json").read_text())
    assert set(fcfs["policies"]) == set(by_priority["policies"]) == {"none", "tokenpools"}
    report = index.read_text()
    assert "# Engines scheduling fcfs" in report and "# Engines scheduling priority" in report
    assert not (out / "families.json").exists()  # no family members asked for


def test_on_priority_engines_llm_d_passes_its_priority_through() -> None:
    shipped = _scenario("fcfs")
    assert shipped.llmd.propagate_priority is False
    on_priority = shipped.on_engines("priority")
    assert on_priority.llmd.propagate_priority is True
    assert on_priority.engine.scheduling_policy == "priority"
    assert on_priority.config().pools["qwen3-8b"].scheduling_policy == "priority"
    back = on_priority.on_engines("fcfs")
    assert (
        back.llmd.propagate_priority is False
        and back.config().pools["qwen3-8b"].scheduling_policy == "fcfs"
    )


def test_the_cli_offers_the_scheduling_policies_the_config_declares() -> None:
    assert tuple(s.value for s in Scheduling) == SCHEDULING_POLICIES
