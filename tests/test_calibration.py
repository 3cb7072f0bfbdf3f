"""Calibration's arithmetic, with the simulator standing in for the real server: a profile the
refinement should recover, and a capacity that means what it says."""

from __future__ import annotations

import math

from tokenpools.engine.profile import load_profile
from tokenpools.real_engines.calibrate import (
    METRICS,
    Fit,
    Observed,
    capacity_rps,
    errors,
    load_scenario,
    quantiles,
    refine,
    simulated,
)
from tokenpools.sim.simulator import simulate

SECONDS, SEED = 60.0, 3


def test_refinement_recovers_the_profile_that_produced_the_observations() -> None:
    truth = load_profile("cpu-smollm2-135m")
    exact = Fit(truth.t0_s, truth.prefill_s_per_token, truth.decode_s_per_seq, 20.0, [])
    capacity = capacity_rps(truth, 70)
    seen = [
        Observed(f * capacity, simulated(truth, exact, f * capacity, SECONDS, SEED))
        for f in (0.3, 0.7)
    ]
    # A first fit that is off: prefill 20 % low, decode 25 % high.
    off = Fit(truth.t0_s, truth.prefill_s_per_token / 1.2, truth.decode_s_per_seq * 1.25, 20.0, [])
    off_mape = sum(
        sum(errors(o.real, simulated(off.profile(truth), off, o.rate_rps, SECONDS, SEED)).values())
        / 4
        for o in seen
    ) / len(seen)
    profile, mape = refine(off, truth, seen, SECONDS, SEED)
    assert mape < 0.02 < off_mape
    assert abs(profile.prefill_s_per_token / truth.prefill_s_per_token - 1) < 0.05
    assert abs(profile.decode_s_per_seq / truth.decode_s_per_seq - 1) < 0.05


def test_capacity_is_where_queueing_starts() -> None:
    profile = load_profile("cpu-smollm2-135m")
    capacity = capacity_rps(profile, 50)

    def ttft_p50(fraction: float) -> float:
        scenario = load_scenario(fraction * capacity, 120.0, SEED)
        return quantiles(simulate(scenario, "none", profile=profile))["ttft_p50_s"]

    unloaded = profile.step_time(50, 0, 0)
    assert ttft_p50(0.5) < 2 * unloaded
    assert ttft_p50(1.5) > 10 * unloaded  # beyond capacity the queue grows without bound


def test_refinement_with_nothing_completed_keeps_the_first_fit() -> None:
    """A window too short for a loaded machine completes nothing: there is nothing to agree
    with, and the first fit stands (it divided by zero)."""
    truth = load_profile("cpu-smollm2-135m")
    fit = Fit(truth.t0_s, truth.prefill_s_per_token, truth.decode_s_per_seq, 20.0, [])
    nothing = {k: float("nan") for k in METRICS} | {"completed": 0.0}
    profile, mape = refine(fit, truth, [Observed(1.0, nothing)], 1.0, SEED)
    assert profile == fit.profile(truth) and math.isnan(mape)
