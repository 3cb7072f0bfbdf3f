"""The simulator survives any valid scenario: tenants of every class, joining and leaving at the
same instants, capacity events on phase boundaries, open and closed loops, several replicas,
under every policy. For each: no exception; every request ends exactly once (completed,
refused, evicted, given up) or is still in flight at the end; nothing is left reserved once the
load has drained; debt within its bounds, priority positive, no negative slot or KV count."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenpools.sim.policies import POLICIES
from tokenpools.sim.scenario import Scenario
from tokenpools.sim.simulator import Simulation

CLASSES = ["dedicated", "guaranteed", "elastic", "spot", "preemptible"]
EDGES = [0.0, 10.0, 20.0, 30.0]  # phase boundaries: joins, leaves and capacity land on them
DURATION = 300.0  # after 30 s no new work: the worst backlog drains (and retries end) by then


@st.composite
def tenants(draw: st.DrawFn, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    name = f"t{index}"
    service_class = draw(st.sampled_from(CLASSES))
    entitlement: dict[str, Any] = {
        "name": name, "tenantId": name, "pool": "p", "serviceClass": service_class,
        "concurrency": draw(st.sampled_from([0, 1, 2, 4])), "sloTargetMs": 2000,
    }  # fmt: skip
    closed = draw(st.booleans())
    if closed:
        clients, think = draw(st.integers(1, 3)), draw(st.sampled_from([0, 0.5]))
        arrivals = {"kind": "closed", "clients": clients, "think_s": think}
    else:
        kind, rate = (
            draw(st.sampled_from(["poisson", "gamma"])),
            draw(st.sampled_from([0.25, 1, 4])),
        )
        arrivals = {"kind": kind, "rate": rate}
    start = draw(st.sampled_from(EDGES[:3]))
    end = draw(st.sampled_from([e for e in EDGES if e > start]))
    tenant: dict[str, Any] = {
        "name": name,
        "retry": {"max_tries": draw(st.integers(1, 4))},
        "entitlement_while_active": draw(st.booleans()),
        "workload": {
            "arrivals": arrivals,
            "prompt": {"kind": "uniform", "low": 16, "high": draw(st.sampled_from([64, 2000]))},
            # heavy outputs only at low rates, so the worst backlog drains before the end
            "output": {
                "kind": "fixed",
                "value": draw(
                    st.sampled_from([8, 64] if arrivals.get("rate") == 4.0 else [8, 64, 200])
                ),
            },
            "start_s": start,
            "end_s": end,
        },
    }
    return entitlement, tenant


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    replicas = draw(st.integers(1, 3))
    count = draw(st.integers(1, 4))
    pairs = [draw(tenants(i)) for i in range(count)]
    capacity = draw(
        st.lists(
            st.fixed_dictionaries(
                {"at_s": st.sampled_from(EDGES[1:]), "fraction": st.sampled_from([0.5, 1.0])}
            ),
            max_size=2,
        )
    )
    data = {
        "name": "generated",
        "duration_s": DURATION,
        "seed": draw(st.integers(0, 1000)),
        "engine": {"profile": "paper-dgx-spark-qwen3-8b", "replicas": replicas},
        "tokenpools": {
            "policy": {"updatePeriodS": 5},
            "pools": [
                {
                    "name": "p",
                    "model": "Qwen3-8B",
                    "replicas": replicas,
                    "perReplica": {"tokensPerSecond": 480, "kvTokens": 65536, "concurrency": 16},
                }
            ],
            "entitlements": [e for e, _ in pairs],
        },
        "tenants": [t for _, t in pairs],
        "phases": [
            {"name": f"ph{i}", "start_s": a, "end_s": b}
            for i, (a, b) in enumerate(zip(EDGES, [*EDGES[1:], DURATION], strict=True))
        ],
        "capacity": capacity,
    }
    return Scenario.model_validate(data)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario=scenarios(), policy=st.sampled_from(list(POLICIES)))
def test_any_valid_scenario_runs_and_conserves_requests(scenario: Scenario, policy: str) -> None:
    sim = Simulation(scenario, policy)
    result = sim.run()
    jobs: dict[int, list[str]] = {}
    for attempt in result.attempts:
        assert attempt.outcome in ("completed", "rejected", "evicted", "pending")
        jobs.setdefault(id(attempt.job), []).append(attempt.outcome)
        if attempt.outcome == "completed":
            assert attempt.finished_at is not None and attempt.finished_at <= DURATION
            assert attempt.first_token_at is None or attempt.first_token_at <= attempt.finished_at
    for outcomes in jobs.values():
        # a job completes at most once, and nothing follows its completion or a pending try
        assert outcomes.count("completed") <= 1
        assert all(o in ("rejected", "evicted") for o in outcomes[:-1]), outcomes
    for sample in result.samples:
        assert sample.waiting >= 0 and sample.running >= 0 and sample.slots >= 0
        assert 0 <= sample.kv_usage <= 1 + 1e-9
        # debt is the clamped service gap's average: in [-1, 1] (below 0: credit from
        # over-service); priority stays positive and finite either way
        for debt, priority in sample.scores.values():
            assert -1 <= debt <= 1 and 0 < priority < math.inf, sample.scores
    # After 30 s no new work: everything has ended by the end, nothing stays reserved.
    assert not any(a.outcome == "pending" for a in result.attempts)
    assert all(engine.num_running == 0 for engine in sim.engines)
    core = getattr(sim.policy, "core", None)
    if core is not None:
        pool = core.store.pool_counters("p", DURATION)
        assert (pool.leases, pool.concurrency, pool.kv_tokens) == (0, 0, 0)
        for name in core.entitlements:
            counters = core.store.entitlement_counters(name, DURATION)
            assert (counters.leases, counters.concurrency) == (0, 0)


def test_two_tenants_joining_at_the_same_instant() -> None:
    """The crash of the event heap's tie-break (two joins at one time compared their actions)."""
    pair = {"arrivals": {"kind": "poisson", "rate": 1.0}, "prompt": {"kind": "fixed", "value": 64},
            "output": {"kind": "fixed", "value": 64}, "start_s": 10, "end_s": 20}  # fmt: skip
    both = ("a", "b")
    pool = {
        "name": "p",
        "model": "Qwen3-8B",
        "perReplica": {"tokensPerSecond": 480, "kvTokens": 65536, "concurrency": 16},
    }
    ents = [
        {"name": n, "tenantId": n, "pool": "p", "serviceClass": "guaranteed", "concurrency": 2}
        for n in both
    ]
    data = {
        "name": "joins", "duration_s": 30, "engine": {"profile": "paper-dgx-spark-qwen3-8b"},
        "tokenpools": {"pools": [pool], "entitlements": ents},
        "tenants": [{"name": n, "entitlement_while_active": True, "workload": pair} for n in both],
        "phases": [{"name": "all", "start_s": 0, "end_s": 30}],
    }  # fmt: skip
    result = Simulation(Scenario.model_validate(data), "tokenpools").run()
    done = {a.job.tenant for a in result.attempts if a.outcome == "completed"}
    assert done == {"a", "b"}
