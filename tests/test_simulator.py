"""The simulator: the paper's experiments reproduced with the real decision core, baselines
that behave as their real counterparts do, determinism, and the CLI."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.builders import SIM_POOL
from tokenpools.cli import app
from tokenpools.shipped import SCENARIOS
from tokenpools.sim.experiments import STATIC_PEAK, run_scenario
from tokenpools.sim.metrics import summarize
from tokenpools.sim.report import waste_table
from tokenpools.sim.scenario import Scenario, load_scenario
from tokenpools.sim.simulator import RunResult, simulate

EXPERIMENTS = SCENARIOS


@cache
def run(name: str, policy: str) -> tuple[RunResult, dict[str, Any]]:
    result = simulate(load_scenario(EXPERIMENTS / f"{name}.yaml"), policy)
    return result, summarize(result)


# -- paper experiment 1 ---------------------------------------------------------------------


def test_exp1_tokenpools_protects_guaranteed_and_keeps_the_engine_queue_empty() -> None:
    _, s = run("paper-exp1", "tokenpools")
    for tenant in ("guaranteed-a", "guaranteed-c"):
        for phase, m in s["tenants"][tenant]["phases"].items():
            if m["completed"]:
                assert m["ttft_p99_s"] <= 1.2, (tenant, phase, m["ttft_p99_s"])
    assert s["engine"]["max_waiting"] <= 2
    spot = s["tenants"]["spot-b"]["phases"]["overload"]
    assert 0.3 <= spot["throttled_fraction"] <= 0.7
    # ~90 %: spot never sits on the guaranteed tenants' idle baselines (docs/decisions.md)
    assert s["utilization"]["overload"] >= 0.89
    assert min(s["utilization"].values()) >= 0.80


def test_exp1_spot_gets_its_share_back_within_5_s_of_the_overload_ending() -> None:
    result, _ = run("paper-exp1", "tokenpools")
    before = [s.running_by_tenant.get("spot-b", 0) for s in result.samples if 10 <= s.t < 30]
    share = sum(before) / len(before)
    during = [s.running_by_tenant.get("spot-b", 0) for s in result.samples if 40 <= s.t < 60]
    # throttled while guaranteed-c is there: about half its share, on average; lent into
    # what the owners leave idle for a moment, it never gets near its share back
    assert sum(during) / len(during) < 0.6 * share
    assert max(during) < 0.8 * share
    back = next(
        s.t
        for s in result.samples
        if s.t >= 60 and s.running_by_tenant.get("spot-b", 0) >= 0.9 * share
    )
    assert back <= 65


def test_exp1_without_admission_control_the_queue_and_latency_explode() -> None:
    _, s = run("paper-exp1", "none")
    assert s["engine"]["waiting_at_phase_end"]["overload"] >= 25
    worst = max(
        m["ttft_p99_s"]
        for t in ("guaranteed-a", "guaranteed-c")
        for m in s["tenants"][t]["phases"].values()
        if m["ttft_p99_s"] is not None
    )
    assert worst >= 10


# -- paper experiment 2 ---------------------------------------------------------------------


def test_exp2_debt_shifts_share_to_the_under_served_and_decays_after_recovery() -> None:
    result, s = run("paper-exp2", "tokenpools")
    low = {t: s["tenants"][t]["totals"]["rejected_low_priority"] for t in s["tenants"]}
    assert low["synth"] > 100
    # As the paper: none for copilot, thanks to check 5's priority margin (without it, a few
    # when synth's debt-raised priority briefly crosses copilot's: docs/experiments.md).
    assert low["copilot"] == 0
    outage = [x for x in result.samples if 30 <= x.t < 120]
    peak = {t: max(x.scores[t][0] for x in outage) for t in ("copilot", "synth")}
    assert 0 < peak["copilot"] < peak["synth"]
    synth_priority = {round(x.scores["synth"][0], 3): x.scores["synth"][1] for x in outage}
    assert synth_priority[round(peak["synth"], 3)] > 20.3 * 1.5  # it rises with its debt
    recovered = next(
        x.t for x in result.samples if x.t >= 120 and max(d for d, _ in x.scores.values()) < 0.05
    )
    assert recovered <= 180


def test_exp2_without_the_priority_margin_copilot_is_shed_on_window_noise() -> None:
    scenario = load_scenario(EXPERIMENTS / "paper-exp2.yaml")
    tokenpools = scenario.tokenpools | {
        "policy": scenario.tokenpools.get("policy", {}) | {"priorityMargin": 0}
    }
    s = summarize(simulate(scenario.model_copy(update={"tokenpools": tokenpools}), "tokenpools"))
    assert s["tenants"]["copilot"]["totals"]["rejected_low_priority"] > 0


# -- preemptible work that completes --------------------------------------------------------


def _with_policy(scenario: Scenario, **policy: object) -> Scenario:
    tokenpools = scenario.tokenpools | {"policy": scenario.tokenpools.get("policy", {}) | policy}
    return scenario.model_copy(update={"tokenpools": tokenpools})


def test_lent_work_taken_back_is_suspended_and_completes_without_costing_protection() -> None:
    _, s = run("beyond-preemptible-waste", "tokenpools")
    batch = s["tenants"]["batch"]["totals"]
    assert batch["completed_per_admitted"] >= 0.95
    assert batch["wasted_output_tokens"] == 0  # nothing thrown away: suspended, then resumed
    assert batch["suspensions"] > 0 and batch["resumed"] > 0
    assert batch["recomputed_prompt_tokens"] > 0  # what the prefix cache did not hold
    assert min(s["useful_utilization"].values()) >= 0.75
    scenario = load_scenario(EXPERIMENTS / "beyond-preemptible-waste.yaml")
    slo = {t.name: t.slo_ttft_s for t in scenario.tenants}
    for name in ("api", "assist"):
        assert s["tenants"][name]["totals"]["ttft_p99_s"] <= slo[name]
    table = waste_table(scenario, {"policies": {"tokenpools": s}})
    assert table is not None
    assert f"| `tokenpools` | {batch['admitted']} | {batch['completed']} |" in table
    exp1 = load_scenario(EXPERIMENTS / "paper-exp1.yaml")
    assert (
        waste_table(exp1, {"policies": {"tokenpools": run("paper-exp1", "tokenpools")[1]}}) is None
    )


def test_without_suspension_the_claims_keep_eviction_waste_low() -> None:
    """Taking back by ending requests (suspend: false): the claims make preemptible work
    mostly complete; claiming nothing (backfillWindowS 0) wastes several times more, and what
    it admits mostly does not complete."""
    scenario = _with_policy(
        load_scenario(EXPERIMENTS / "beyond-preemptible-waste.yaml"), suspend=False
    )
    evicting = summarize(simulate(scenario, "tokenpools"))
    batch = evicting["tenants"]["batch"]["totals"]
    assert batch["completed_per_admitted"] >= 0.8
    assert 0 < batch["wasted_output_tokens"] < 2000
    assert batch["suspensions"] == 0
    lent = summarize(simulate(_with_policy(scenario, backfillWindowS=0), "tokenpools"))
    lent_batch = lent["tenants"]["batch"]["totals"]
    assert lent_batch["wasted_output_tokens"] > 3 * batch["wasted_output_tokens"]
    assert lent_batch["completed_per_admitted"] < 0.5


def _p99_ttft(result: RunResult, tenants: tuple[str, ...], start: float, end: float) -> float:
    ttfts = sorted(
        a.first_token_at - a.req.sent_at
        for a in result.attempts
        if a.req.tenant in tenants and a.first_token_at is not None and start <= a.req.sent_at < end
    )
    return ttfts[int(0.99 * len(ttfts))]


def _surplus_running(result: RunResult, start: float, end: float) -> float:
    counts = [
        x.running_by_tenant.get("scrape", 0) + x.running_by_tenant.get("batch", 0)
        for x in result.samples
        if start <= x.t < end
    ]
    return sum(counts) / len(counts)


def test_a_restart_on_a_shared_store_goes_unnoticed_and_on_an_empty_one_it_does_not() -> None:
    scenario = load_scenario(EXPERIMENTS / "beyond-restart.yaml")
    assert [(r.at_s, r.store) for r in scenario.restarts] == [(100, "empty"), (200, "empty")]
    kept = scenario.model_copy(
        update={"restarts": [r.model_copy(update={"store": "kept"}) for r in scenario.restarts]}
    )
    empty_run, kept_run = simulate(scenario, "tokenpools"), simulate(kept, "tokenpools")
    protected = ("api", "chat")
    before = _p99_ttft(kept_run, protected, 30, 100)
    steady = _surplus_running(kept_run, 50, 100)
    for at in (100, 200):
        # The store kept the leases in flight and every claim: the protected tenants see
        # nothing; surplus work loses a little for a while (the pool's learnt scale is the
        # process's, back at 1), not its share.
        assert _p99_ttft(kept_run, protected, at, at + 60) <= max(2 * before, 0.5)
        assert _surplus_running(kept_run, at + 10, at + 30) >= 0.7 * steady
        # (0.88 at 100 s since spot work is lent too: the steady share it is measured
        # against is higher, and the restarted process learns it back over a minute)
        assert _surplus_running(kept_run, at + 30, at + 60) >= 0.85 * steady
    # An empty store knows nothing of what runs on the engines: the new process admits on
    # top of it and the protected tenants' first-token latency pays (docs/decisions.md).
    assert max(_p99_ttft(empty_run, protected, at, at + 60) for at in (100, 200)) > 1.5


# -- determinism and the contract -----------------------------------------------------------


def test_same_seed_gives_byte_identical_summaries_and_another_seed_does_not() -> None:
    scenario = load_scenario(EXPERIMENTS / "paper-exp1.yaml")
    first, _ = run_scenario(scenario, ["tokenpools", "vtc", "llm-d"], seed=7)
    again, _ = run_scenario(scenario, ["tokenpools", "vtc", "llm-d"], seed=7)
    other, _ = run_scenario(scenario, ["tokenpools", "vtc", "llm-d"], seed=8)
    assert json.dumps(first) == json.dumps(again)
    assert json.dumps(first) != json.dumps(other)


def test_summary_has_the_documented_shape() -> None:
    _, s = run("paper-exp1", "tokenpools")
    metric_keys = {
        "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "e2e_p99_s", "submitted", "admitted",
        "completed", "rejected", "rejected_low_priority", "evicted", "output_tok_s",
        "goodput_rps",
    }  # fmt: skip
    for tenant in s["tenants"].values():
        assert {"class", "peak_debt", "totals", "phases"} <= set(tenant)
        assert metric_keys <= set(tenant["totals"])
        assert set(tenant["phases"]) == {"before", "overload", "after"}
    assert {"max_waiting", "waiting_at_phase_end"} <= set(s["engine"])
    assert set(s["utilization"]) == {"before", "overload", "after"}
    assert {
        "vtc_service_difference", "jain_index", "slo_attainment", "slo_attainment_split"
    } == set(s["fairness"])  # fmt: skip
    assert set(s["fairness"]["slo_attainment"]) == {"guaranteed", "spot"}
    assert set(s["fairness"]["slo_attainment_split"]) == {"guaranteed"}
    for tenant in s["tenants"].values():
        assert {"suspended", "suspensions", "resumed", "suspended_p50_s", "suspended_p99_s",
                "recomputed_prompt_tokens"} <= set(tenant["totals"])  # fmt: skip


# -- baselines behave like the real thing ---------------------------------------------------


def tiny(tenants: list[dict[str, Any]], ents: list[dict[str, Any]], **extra: Any) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "tiny",
            "duration_s": extra.pop("duration_s", 60),
            "engine": {"profile": "paper-dgx-spark-qwen3-8b"},
            "tokenpools": {
                "pools": [SIM_POOL],
                "entitlements": [{"tenantId": e["name"], "pool": "p", **e} for e in ents],
            },
            "phases": [{"name": "all", "start_s": 0, "end_s": extra.pop("duration_s", 60)}],
            "tenants": tenants,
            **extra,
        }
    )


def load(name: str, rate: float, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "workload": {
            "arrivals": {"kind": "poisson", "rate": rate},
            "prompt": {"kind": "fixed", "value": 64},
            "output": {"kind": "fixed", "value": 64},
        },
        **extra,
    }


def test_request_rate_caps_each_calendar_minute() -> None:
    scenario = tiny(
        [load("a", 3.0, limits={"rpm": 30})],
        [{"name": "a", "serviceClass": "elastic", "concurrency": 4}],
    )
    result = simulate(scenario, "request-rate")
    admitted = [a for a in result.attempts if a.outcome != "rejected"]
    assert len(admitted) == 30
    assert {a.reason for a in result.attempts if a.outcome == "rejected"} == {"rate_limited"}


def test_token_rate_counted_after_the_response_overshoots_its_limit() -> None:
    # 1,280 tokens per minute: about ten requests — but they all pass before any completes.
    scenario = tiny(
        [load("a", 4.0, limits={"tpm": 1280})],
        [{"name": "a", "serviceClass": "elastic", "concurrency": 4}],
    )
    result = simulate(scenario, "token-rate")
    served = sum(
        a.req.prompt_tokens + a.output_tokens
        for a in result.attempts
        if a.outcome == "completed" and a.finished_at is not None and a.finished_at < 60
    )
    assert served > 2 * 1280


def test_static_concurrency_never_exceeds_the_limit() -> None:
    scenario = tiny(
        [load("a", 3.0, limits={"concurrency": 3})],
        [{"name": "a", "serviceClass": "elastic", "concurrency": 4}],
    )
    result = simulate(scenario, "concurrency")
    assert max(s.running_by_tenant.get("a", 0) for s in result.samples) <= 3
    assert any(a.reason == "concurrency_limit" for a in result.attempts)


def test_priority_shed_rejects_only_sheddable_traffic_and_only_when_saturated() -> None:
    scenario = tiny(
        [load("gold", 2.0), load("spot", 6.0)],
        [
            {"name": "gold", "serviceClass": "guaranteed", "concurrency": 6},
            {"name": "spot", "serviceClass": "spot"},
        ],
    )
    result = simulate(scenario, "priority-shed")
    rejected = [a for a in result.attempts if a.outcome == "rejected"]
    assert rejected and {a.req.tenant for a in rejected} == {"spot"}
    assert {a.reason for a in rejected} == {"shed"}


def test_vtc_rejects_nothing_and_shares_service_fairly_between_backlogged_tenants() -> None:
    scenario = tiny(
        [load("a", 6.0), load("b", 6.0)],
        [
            {"name": "a", "serviceClass": "elastic", "concurrency": 8},
            {"name": "b", "serviceClass": "elastic", "concurrency": 8},
        ],
    )
    result = simulate(scenario, "vtc")
    assert all(a.outcome != "rejected" for a in result.attempts)
    fairness = summarize(result)["fairness"]
    assert fairness["jain_index"] >= 0.95
    # both asked for 6 slots of 8 on a 16-slot engine: served alike, within a few tokens/s
    assert fairness["vtc_service_difference"]["mean"] < 50


# -- the command line -----------------------------------------------------------------------


def test_simulate_command_writes_summary_report_and_figures(tmp_path: Path) -> None:
    out = tmp_path / "exp1"
    cli = CliRunner().invoke(
        app,
        [
            "simulate",
            str(EXPERIMENTS / "paper-exp1.yaml"),
            "-p",
            "tokenpools",
            "-p",
            "none",
            "--out",
            str(out),
        ],
    )
    assert cli.exit_code == 0, cli.output
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"tokenpools", "none"}
    assert "| `tokenpools` |" in (out / "report.md").read_text()
    assert (out / "paper-exp1-priority.png").stat().st_size > 10_000


def test_simulate_command_rejects_an_unknown_policy_and_a_bad_scenario(tmp_path: Path) -> None:
    cli = CliRunner().invoke(app, ["simulate", str(EXPERIMENTS / "paper-exp1.yaml"), "-p", "fifo"])
    assert cli.exit_code == 1 and "unknown policy 'fifo'" in cli.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nduration_s: -1\n")
    cli = CliRunner().invoke(app, ["simulate", str(bad)])
    assert cli.exit_code == 1 and "duration_s" in cli.output


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_is_valid(path: Path) -> None:
    scenario = load_scenario(path)
    scenario.config()
    assert scenario.phases and scenario.tenants


def test_autoscaling_adds_replicas_after_a_cold_start_and_costs_less_than_the_peak() -> None:
    scenario = load_scenario(EXPERIMENTS / "beyond-autoscaling.yaml")
    assert scenario.autoscaling is not None
    summary, results = run_scenario(scenario, ["tokenpools"])
    auto = summary["policies"]["tokenpools"]["replicas"]
    static = summary["policies"][STATIC_PEAK]["replicas"]
    assert auto["peak"] == 3 and static["peak"] == 3
    assert static["replica_seconds"] == 3 * scenario.duration_s
    assert auto["replica_seconds"] < 0.9 * static["replica_seconds"]
    # protected tenants keep their SLO within their baselines on the autoscaled pool as on the
    # static peak (TTFT from each job's first attempt: refusals waited out count, on both pools
    # alike). Their excess above the baseline is not promised: on a pool lent to the full its
    # requests wait longer for the entitlement's own concurrency (90 % of all jobs met here).
    within = {
        name: summary["policies"][name]["fairness"]["slo_attainment_split"]["guaranteed"]["within"]
        for name in ("tokenpools", STATIC_PEAK)
    }
    assert within["tokenpools"] >= 0.99
    assert within["tokenpools"] >= within[STATIC_PEAK] - 0.01
    assert auto["protected_slo_attainment"] >= 0.85
    # every replica asked for serves one cold start later, in order; then the pool shrinks
    log = results[0].scaling
    asked = [t for t, what in log if what == "ask"]
    served = [t for t, what in log if what == "serve"]
    assert len(asked) == len(served) == 2
    assert served == [t + scenario.autoscaling.cold_start_s for t in asked]
    assert any(what == "drain" for _, what in log)
    assert results[0].samples[-1].slots < 48
