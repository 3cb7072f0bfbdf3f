"""llm-d's flow control in the simulator (sim/llmd_parts.py, sim/llmd_flow.py) and tokenpools in
front of it (sim/tokenpools_llmd.py): each documented rule of llm-d's holds, on its own and on
the generated preemptible family (pools of 1–4 replicas, every class, bursts, capacity drops)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.builders import SIM_POOL
from tokenpools.model.objectives import PRIORITY
from tokenpools.model.service_class import ServiceClass
from tokenpools.sim.family import family_scenario
from tokenpools.sim.llmd_flow import LlmdFlowControl
from tokenpools.sim.llmd_parts import (
    LeastAttainedService,
    SoftReflectiveCeiling,
    concurrency_saturation,
    holdback_ceilings,
    revocations,
    utilization_saturation,
)
from tokenpools.sim.policy import EndpointLoad, SimRequest
from tokenpools.sim.scenario import Scenario
from tokenpools.sim.simulator import Simulation

MEMBERS = range(0, 10)


# -- the pieces, against llm-d's formulas ------------------------------------------------------


def test_utilization_detector_is_the_mean_of_each_endpoints_roofline() -> None:
    # endpoint 1: queue 5/5 = 1.0 beats KV 0.4/0.8; endpoint 2: KV 0.6/0.8 = 0.75 beats queue 0
    loads = [EndpointLoad(5, 16, 16, 0.4), EndpointLoad(0, 10, 16, 0.6)]
    assert utilization_saturation(loads) == pytest.approx((1.0 + 0.75) / 2)
    assert utilization_saturation([]) == 1.0  # no endpoint: saturated (fail closed)
    assert concurrency_saturation(loads, 16) == pytest.approx((21 + 10) / 32)


def test_holdback_gives_the_lowest_band_min_ceiling_by_rank_or_by_value() -> None:
    assert holdback_ceilings([10, 0, -10, -20], 0.4) == pytest.approx([1.0, 0.8, 0.6, 0.4])
    by_value = holdback_ceilings([10, 0, -20], 0.4, domain="value")
    assert by_value == pytest.approx([1.0, 0.4 + 0.6 * 20 / 30, 0.4])
    assert holdback_ceilings([0], 0.4) == [1.0]  # one band: never held back


@pytest.mark.parametrize(
    ("sat", "bands", "lowest"),
    [
        # below every reflective ceiling (s < 1 − s): all open, every cycle
        (0.4, 2, "1111111111"),
        # s = 0.5: round(0.5 / 0.5) = 1, open on every cycle
        (0.5, 3, "1111111111"),
        # s = 0.7: round(0.7 / 0.3) = round(2.33) = 2: the tick reads 1, 2, 3, ... and the
        # bands open when it is a multiple of 2
        (0.7, 2, "0101010101"),
        # s = 0.75: round(3) = 3, open on the 3rd, 6th and 9th cycles
        (0.75, 2, "0010010010"),
        (0.75, 4, "0010010010"),
        # s = 0.8: round(4) = 4, open on the 4th and 8th
        (0.8, 3, "0001000100"),
        # saturated: closed
        (1.0, 2, "0000000000"),
        (1.3, 5, "0000000000"),
    ],
)
def test_soft_ceiling_opens_gated_bands_on_one_cycle_in_a_period(
    sat: float, bands: int, lowest: str
) -> None:
    policy = SoftReflectiveCeiling()
    runs = [policy.ceilings(sat, bands) for _ in range(10)]  # ten cycles
    assert all(r[0] == 1.0 for r in runs)  # band 0 is never gated by the policy
    assert "".join(str(int(r[-1])) for r in runs) == lowest
    # monotone in rank: a band is never closed while a lower one is open
    assert all(r == sorted(r, reverse=True) for r in runs)


def test_soft_ceiling_counts_the_calls_made_while_a_band_alternates() -> None:
    # s = 0.75: open on every 3rd call made while some band alternates; calls below s = 0.5
    # (no band alternates) leave the tick where it was
    policy = SoftReflectiveCeiling()
    assert [policy.ceilings(0.75, 2)[1] for _ in range(2)] == [0.0, 0.0]
    assert policy.ceilings(0.3, 2) == [1.0, 1.0]
    assert policy.calls_to_open(0.75) == 1
    assert policy.ceilings(0.75, 2) == [1.0, 1.0]
    assert policy.calls_to_open(0.75) == 3
    policy.advance(0.75, 2, 2)  # two cycles that did not need their ceilings
    assert policy.ceilings(0.75, 2) == [1.0, 1.0]


@given(
    st.lists(st.tuples(st.floats(0, 300), st.integers(0, 2000), st.integers(0, 2000)), max_size=8),
    st.floats(0, 600),
)
def test_attained_service_decays_with_a_60_s_half_life(
    events: list[tuple[float, int, int]], later: float
) -> None:
    las = LeastAttainedService()
    expected, last = 0.0, 0.0
    for t, prompt, output in sorted(events):
        expected = expected * math.exp2(-(t - last) / 60) + prompt + 2 * output
        las.completed("p", prompt, output, t)
        last = t
    if events:
        end = last + later
        assert las.service("p", end) == pytest.approx(
            expected * math.exp2(-later / 60), rel=1e-9, abs=1e-9
        )


def test_least_attained_service_wins_and_head_wait_breaks_a_tie() -> None:
    las = LeastAttainedService()
    las.completed("heavy", 1000, 1000, 0.0)
    las.completed("light", 100, 100, 0.0)
    # light's lower service outweighs heavy's longer wait (0.8 against 0.2)
    assert las.pick({"heavy": 0.0, "light": 9.0}, 10.0) == "light"
    # equal service (two new programs): the older head wins
    assert las.pick({"a": 5.0, "b": 1.0}, 10.0) == "b"
    # after ten half-lives heavy's lead is gone to within a token: the wait decides again
    las.completed("light", 1000, 1000, 600.0)
    assert las.service("heavy", 600.0) < 3 and las.service("light", 600.0) > 2999
    assert las.pick({"heavy": 590.0, "light": 599.0}, 600.0) == "heavy"


def test_revocations_cover_the_deficit_at_the_mean_footprint_capped_at_two() -> None:
    # saturation 1.2 over 12 in flight: 0.1 each; deficit 0.2 → 2
    assert revocations(1.2, 1.0, 12, 5) == 2
    assert revocations(1.0, 1.0, 12, 5) == 1  # at the boundary: at least one
    assert revocations(3.0, 1.0, 4, 5) == 2  # capped by maxRevocationsPerDecision
    assert revocations(1.5, 1.0, 4, 1) == 1  # and by what is evictable
    assert revocations(0.9, 1.0, 4, 5) == 0


# -- the policy in the simulator ---------------------------------------------------------------


POOL = {
    "name": "p",
    "model": "Qwen3-8B",
    "perReplica": {"tokensPerSecond": 480, "kvTokens": 65536, "concurrency": 16},
}


def _band_of(sim: Simulation, tenant: str) -> int:
    ent = sim.config.entitlements[sim.tenants[tenant].entitlement or tenant]
    return PRIORITY[ent.service_class]


@pytest.mark.parametrize("index", MEMBERS)
def test_strict_band_order_and_eviction_of_sheddable_work_only(index: int) -> None:
    """Every request dispatched comes from the highest band with work waiting (static
    ceilings: one saturation for all bands); every eviction hits a negative band."""
    sim = Simulation(family_scenario(index), "llm-d")
    policy = sim.policy
    assert isinstance(policy, LlmdFlowControl)
    dispatch = policy.dispatch
    inversions: list[tuple[float, int, int]] = []

    def checked(now: float, free: int) -> list[SimRequest]:
        waiting = [p for p, n in policy.queued().items() if n]
        out = dispatch(now, free)
        for req in out:
            band = policy.band_of[req.entitlement]
            if band != max(waiting):
                inversions.append((now, band, max(waiting)))
        return out

    policy.dispatch = checked  # type: ignore[method-assign]
    result = sim.run()
    assert inversions == []
    evicted = {a.req.tenant for a in result.attempts if a.outcome == "evicted"}
    assert all(_band_of(sim, t) < 0 for t in evicted)
    assert any(a.started_at is not None for a in result.attempts)


def test_the_family_shows_evictions_and_no_protected_request_is_ever_evicted() -> None:
    evictions = 0
    for index in MEMBERS:
        for policy in ("llm-d", "tokenpools+llm-d"):
            sim = Simulation(family_scenario(index), policy)
            result = sim.run()
            for a in result.attempts:
                if a.outcome == "evicted":
                    evictions += 1
                    cls = sim.config.entitlements[a.req.entitlement].service_class
                    assert cls in (ServiceClass.SPOT, ServiceClass.PREEMPTIBLE), (index, policy)
    assert evictions > 100  # the rule is exercised, not vacuous


def _two_tenants(llmd: dict[str, Any], clients: int = 24) -> Scenario:
    """A guaranteed tenant backlogged beyond one engine (16 slots, 5 waiting at saturation)
    and a spot one behind it."""
    return Scenario.model_validate(
        {
            "name": "two",
            "duration_s": 150,
            "engine": {"profile": "paper-dgx-spark-qwen3-8b"},
            "llmd": llmd,
            "tokenpools": {
                "pools": [SIM_POOL],
                "entitlements": [
                    {
                        "name": "g",
                        "tenantId": "g",
                        "pool": "p",
                        "serviceClass": "guaranteed",
                        "concurrency": 16,
                        "sloTargetMs": 1000,
                    },
                    {"name": "s", "tenantId": "s", "pool": "p", "serviceClass": "spot"},
                ],
            },
            "tenants": [
                {
                    "name": n,
                    "retry": {"max_tries": 1},
                    "workload": {
                        "arrivals": {"kind": "closed", "clients": c},
                        "prompt": {"kind": "fixed", "value": 64},
                        "output": {"kind": "fixed", "value": 256},
                    },
                }
                for n, c in (("g", clients), ("s", 20))
            ],
            "phases": [{"name": "all", "start_s": 0, "end_s": 150}],
        }
    )


def test_a_starved_band_times_out_after_the_ttl_and_a_full_band_refuses() -> None:
    # The concurrency detector reads llm-d's own counters, so guaranteed's band is never below
    # its ceiling while it has work queued; the utilisation detector's 50 ms-old scrape would
    # let a stale window release spot requests too (tests/test_llmd_upstream.py).
    result = Simulation(
        _two_tenants({"request_ttl_s": 30, "detector": "concurrency"}), "llm-d"
    ).run()
    timed_out = [a for a in result.attempts if a.reason == "queue_timeout"]
    assert timed_out and {a.req.tenant for a in timed_out} == {"s"}
    # swept once a second: refused between 30 and 31 s after it was sent, never earlier
    waits = [a.finished_at - a.req.sent_at for a in timed_out if a.finished_at is not None]
    assert min(waits) >= 30 and max(waits) <= 31 + 1e-9
    full = Simulation(_two_tenants({"band_max_requests": 3}), "llm-d").run()
    refused = [a for a in full.attempts if a.reason == "queue_full"]
    assert refused and all(a.finished_at == a.req.sent_at for a in refused)


def test_priority_holdback_keeps_the_lower_band_to_its_ceiling() -> None:
    """The four declared bands (10, 0, −10, −20) by rank put spot's ceiling at
    1 − 2 · 0.8 / 3 ≈ 0.47 under holdback with minCeiling 0.2, against 1.0 under the static
    ceiling: with the concurrency detector (16 in flight is saturation 1.0) spot holds about 7
    of the engine's 16 slots, not 12."""

    def spot_running(llmd: dict[str, Any]) -> float:
        result = Simulation(_two_tenants(llmd, clients=4), "llm-d").run()
        running = [s.running_by_tenant.get("s", 0) for s in result.samples if s.t >= 30]
        return sum(running) / len(running)

    assert spot_running({"detector": "concurrency"}) > 10
    held = {"detector": "concurrency", "usage_limit": "priority-holdback", "min_ceiling": 0.2}
    assert 6 < spot_running(held) < 8
