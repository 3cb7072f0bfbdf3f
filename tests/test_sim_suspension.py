"""Suspend and resume in the simulator (sim/suspension.py), over generated scenarios of both
families on both engine schedulings: lent work taken back is suspended, keeps its output, and
resumes as a continuation; nothing is lost or doubled, and no lease outlives its request."""

from __future__ import annotations

import pytest

from tokenpools.shipped import SCENARIOS
from tokenpools.sim.fairness import asked_within
from tokenpools.sim.family import family_scenario
from tokenpools.sim.family_fair import fair_scenario
from tokenpools.sim.metrics import summarize
from tokenpools.sim.records import Attempt
from tokenpools.sim.scenario import Scenario, load_scenario
from tokenpools.sim.simulator import Simulation, simulate
from tokenpools.sim.tokenpools_policy import TokenPools

MEMBERS = [
    pytest.param(family, index, scheduling, id=f"{family.__name__}-{index}-{scheduling}")
    for family, index, scheduling in (
        (family_scenario, 0, "priority"),
        (family_scenario, 2, "fcfs"),
        (family_scenario, 4, "priority"),
        (family_scenario, 9, "fcfs"),
        (fair_scenario, 1, "priority"),
        (fair_scenario, 5, "fcfs"),
    )
]


def _shortened(scenario: Scenario, end_s: float) -> Scenario:
    """The same scenario stopped mid-way, so work is in flight and suspended at the end."""
    return scenario.model_copy(update={"duration_s": end_s})


@pytest.mark.parametrize(("family", "index", "scheduling"), MEMBERS)
def test_every_admitted_attempt_ends_once_with_every_output_token_once(
    family: object, index: int, scheduling: str
) -> None:
    scenario = family(index).on_engines(scheduling)  # type: ignore[operator]
    sim = Simulation(_shortened(scenario, 75.0), "tokenpools")
    result = sim.run()
    policy = sim.policy
    assert isinstance(policy, TokenPools) and policy.suspends
    running = sim.running  # request (segment) id → attempt
    suspended = sim.suspended
    attempts_running = {id(a) for a in running.values()}
    attempts_suspended = {id(h.attempt) for h in suspended.values()}
    assert not attempts_running & attempts_suspended, "an attempt both running and suspended"
    suspensions = 0
    for a in result.attempts:
        suspensions += a.suspensions
        assert a.resumes <= a.suspensions
        if a.outcome == "completed":
            # the client's answer: exactly what the job asked the engine for, once
            assert a.output_tokens == a.job.output_tokens
            assert a.first_token_at is not None and a.finished_at is not None
        elif a.outcome == "pending":
            assert (id(a) in attempts_running) != (id(a) in attempts_suspended)
            assert a.output_tokens < a.job.output_tokens
        elif a.outcome == "evicted":  # only a deadline ends suspended work
            assert a.reason == "suspended" and a.suspensions > a.resumes
    assert suspensions > 0, "the scenario takes lent work back"
    # No lease outlives its request: the store holds exactly the running segments' leases.
    assert set(policy.core.store.leases) == set(running)


def test_a_resumed_request_prefills_only_what_its_replica_lost() -> None:
    scenario = family_scenario(4).on_engines("priority")
    block = summarize(Simulation(scenario, "tokenpools").run())
    totals = [t["totals"] for t in block["tenants"].values()]
    resumed = sum(t["resumed"] for t in totals)
    recomputed = sum(t["recomputed_prompt_tokens"] for t in totals)
    assert resumed > 20
    # a continuation's prompt is its original and its output so far (hundreds of tokens);
    # with its prefix cached on the replica it returns to, it prefills a block or so
    assert recomputed / resumed < 64


def test_a_suspended_attempt_ends_at_its_deadline_and_its_client_retries() -> None:
    scenario = family_scenario(4).on_engines("priority")
    policy = scenario.tokenpools.get("policy", {}) | {
        "suspendDeadlineS": {"preemptible": 0.5, "spot": 0.5}
    }
    short = scenario.model_copy(update={"tokenpools": scenario.tokenpools | {"policy": policy}})
    result = Simulation(short, "tokenpools").run()
    ended = [a for a in result.attempts if a.outcome == "evicted"]
    assert ended and all(a.reason == "suspended" for a in ended)
    for a in ended:
        assert a.suspended_s >= 0.5 - 1e-9
    # their clients tried again: a later attempt of the same job
    jobs = {id(a.job) for a in ended}
    assert any(a.number > 1 and id(a.job) in jobs for a in result.attempts)


def test_without_suspension_taking_back_ends_requests() -> None:
    scenario = family_scenario(4).on_engines("priority")
    policy = scenario.tokenpools.get("policy", {}) | {"suspend": False}
    off = scenario.model_copy(update={"tokenpools": scenario.tokenpools | {"policy": policy}})
    result = Simulation(off, "tokenpools").run()
    assert all(a.suspensions == 0 for a in result.attempts)
    assert any(a.outcome == "evicted" and a.reason == "evicted" for a in result.attempts)


def test_slo_attainment_is_split_into_what_was_promised_and_the_excess() -> None:
    """paper-exp1's guaranteed tenants ask above their entitlements (their Poisson demand
    averages it): the jobs within them meet the SLO, the excess (refused by the entitlement's
    own limit, then retried) mostly does not; a policy that knows no baselines gives no split."""
    scenario = load_scenario(SCENARIOS / "paper-exp1.yaml").on_engines("priority")
    ours = summarize(simulate(scenario, "tokenpools"))["fairness"]
    split = ours["slo_attainment_split"]
    assert set(split) == {"guaranteed"}  # promised baselines only
    assert split["guaranteed"]["within"] >= 0.9
    assert split["guaranteed"]["above"] < 0.5
    assert split["guaranteed"]["above"] < ours["slo_attainment"]["guaranteed"]
    theirs = summarize(simulate(scenario, "llm-d-legacy"))["fairness"]
    assert theirs["slo_attainment_split"] == {}


def test_a_job_refused_room_above_its_baseline_counts_as_excess() -> None:
    """Where lent work fills the pool, a protected tenant's burst above its baseline is refused
    room (nothing is taken back for it): such a job is excess, not a broken promise. A job
    counted within its entitlement was within its baseline when first refused, if it was."""
    refused_above = refused_within = 0
    for member in range(6):
        result = simulate(fair_scenario(member).on_engines("fcfs"), "tokenpools", 1)
        jobs: dict[int, list[Attempt]] = {}
        for a in result.attempts:
            jobs.setdefault(id(a.job), []).append(a)
        for attempts in jobs.values():
            first = min(attempts, key=lambda a: a.req.sent_at)
            if first.outcome != "rejected" or first.reason != "pool_full":
                continue
            assert first.req.within is not None  # the policy says which side it asked on
            refused_above += first.req.within is False
            refused_within += first.req.within is True
            assert asked_within(attempts) == first.req.within
    assert refused_above > 0  # the case happened
    assert refused_within <= refused_above / 10  # the pool's promise is rarely what refused
