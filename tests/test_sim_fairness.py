"""The fairness measures of every policy's summary (sim/fairness.py), on traces small enough to
check by hand and on generated traces whose answer is known (everyone served what it asked)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.builders import SIM_POOL
from tokenpools.sim.fairness import (
    entitled_jain_index,
    fairness_block,
    jobs_within_slo,
    service_difference,
    slo_attainment_by_class,
    window_difference,
)
from tokenpools.sim.records import Attempt, Job, RunResult
from tokenpools.sim.scenario import Scenario

POOL = {
    "name": "p",
    "model": "Qwen3-8B",
    "perReplica": {"tokensPerSecond": 480, "kvTokens": 65536, "concurrency": 16},
}


def _scenario(duration: float, extra_tenants: tuple[str, ...] = ()) -> Scenario:
    names = ("a", "b", *extra_tenants)
    return Scenario.model_validate(
        {
            "name": "trace",
            "duration_s": duration,
            "engine": {"profile": "paper-dgx-spark-qwen3-8b"},
            "tokenpools": {
                "pools": [SIM_POOL],
                "entitlements": [
                    {
                        "name": n,
                        "tenantId": n,
                        "pool": "p",
                        "serviceClass": "elastic",
                        "concurrency": 8,
                        "sloTargetMs": 5000,
                    }
                    for n in names
                ],
            },
            "tenants": [
                {
                    "name": n,
                    "workload": {
                        "arrivals": {"kind": "poisson", "rate": 1},
                        "prompt": {"kind": "fixed", "value": 1},
                        "output": {"kind": "fixed", "value": 1},
                    },
                }
                for n in names
            ],
            "phases": [{"name": "all", "start_s": 0, "end_s": duration}],
        }
    )


def _attempt(
    tenant: str, prompt: int, output: int, sent: float, first: float | None, end: float | None
) -> Attempt:
    job = Job(tenant, prompt, output, output)
    a = Attempt(job.request(f"{tenant}-{sent}-{first}", tenant, sent), job, 1)
    if first is None:
        a.outcome, a.reason, a.finished_at = "rejected", "low_priority", sent
    else:
        a.outcome, a.first_token_at, a.finished_at = "completed", first, end
        a.output_tokens, a.started_at = output, sent
    return a


def _result(scenario: Scenario, attempts: list[Attempt]) -> RunResult:
    return RunResult(scenario, "trace", 1, scenario.config(), attempts, [], {})


def test_the_measures_on_a_trace_checked_by_hand() -> None:
    # a asks for three requests of 100 in / 50 out (VTC cost 200 each) and gets one, first token
    # 5 s after it was sent; b asks for two of 100 / 100 (cost 300) and gets both.
    trace = [
        _attempt("a", 100, 50, 5.0, 10.0, 20.0),
        _attempt("a", 100, 50, 6.0, None, None),
        _attempt("a", 100, 50, 7.0, None, None),
        _attempt("b", 100, 100, 1.0, 2.0, 12.0),
        _attempt("b", 100, 100, 3.0, 4.0, 30.0),
    ]
    result = _result(_scenario(60), trace)
    diff = service_difference(result)
    assert diff is not None
    # one 60 s window: a served 200/60, asked 600/60; b served and asked 600/60:
    # a is behind by min(10 − 3.33, 10 − 3.33) = 6.67 tokens/s
    assert diff["max"] == pytest.approx(400 / 60)
    assert diff["by_class"]["elastic"]["mean"] == pytest.approx(400 / 60)
    # served/asked (entitlement 240 tokens/s is above both): a 150/450, b 400/400 → x = 1/3, 1
    assert entitled_jain_index(result) == pytest.approx((4 / 3) ** 2 / (2 * (1 / 9 + 1)))
    # 5 jobs, 3 completed within 5 s (a's took exactly 5 s: within)
    assert slo_attainment_by_class(result) == {"elastic": pytest.approx(0.6)}
    block = fairness_block(result)
    assert set(block) == {
        "vtc_service_difference", "jain_index", "slo_attainment", "slo_attainment_split"
    }  # fmt: skip
    assert block["slo_attainment_split"] == {}  # elastic only: no baseline is promised


def test_a_jobs_ttft_runs_from_its_first_attempt_not_its_last_retry() -> None:
    # One job of a, refused with Retry-After three times (sent at 0, 2, 4), then sent at 6 and
    # served: first token at 6.5, half a second after its last retry but 6.5 s after it was
    # first sent. The SLO is 5 s: a miss. b's job is served on its one attempt in 1 s: a hit.
    job = Job("a", 10, 10, 10)
    trace = []
    for n, sent in enumerate((0.0, 2.0, 4.0), start=1):
        refused = Attempt(job.request(f"a-{n}", "a", sent), job, n)
        refused.outcome, refused.reason, refused.finished_at = "rejected", "low_priority", sent
        trace.append(refused)
    served = Attempt(job.request("a-4", "a", 6.0), job, 4)
    served.outcome, served.first_token_at, served.finished_at = "completed", 6.5, 7.0
    served.output_tokens, served.started_at = 10, 6.0
    trace += [served, _attempt("b", 10, 10, 0.0, 1.0, 2.0)]
    result = _result(_scenario(60), trace)
    assert jobs_within_slo(result) == {"a": (1, 0), "b": (1, 1)}
    assert slo_attainment_by_class(result) == {"elastic": pytest.approx(0.5)}
    # the same job, first sent at 2 instead: 4.5 s from its first attempt, within the SLO
    trace[0].req.sent_at = 2.0
    assert jobs_within_slo(result)["a"] == (1, 1)


def test_service_is_spread_over_each_requests_decode_across_windows() -> None:
    # one request decoding from 50 s to 70 s: half its cost falls in each 60 s window
    trace = [_attempt("a", 0, 300, 49.0, 50.0, 70.0), _attempt("b", 0, 0, 0.0, None, None)]
    result = _result(_scenario(120), trace)
    diff = service_difference(result, window_s=60, step_s=60)
    assert diff is not None
    # a asked 600/60 in window 1 and got 300/60; b asked nothing: a is not behind b (b is
    # served less, but wanted nothing) and b is not behind a
    assert diff["max"] == 0.0


def test_a_tenant_still_waiting_on_an_earlier_burst_stays_backlogged() -> None:
    # Windows [0, 60) and [60, 120). a sends one job (0 in / 300 out: cost 600) at 10; it is
    # refused and retried until a last refusal at 100, never served. b sends one job of the same
    # cost at 65, decoded 70-100: 600/60 = 10 tokens/s of service in the second window.
    job = Job("a", 0, 300, 300)
    trace = []
    for n, sent in enumerate((10.0, 40.0, 70.0, 100.0), start=1):
        refused = Attempt(job.request(f"a-{n}", "a", sent), job, n)
        refused.outcome, refused.reason, refused.finished_at = "rejected", "low_priority", sent
        trace.append(refused)
    trace.append(_attempt("b", 0, 300, 65.0, 70.0, 100.0))
    result = _result(_scenario(120), trace)
    diff = service_difference(result, window_s=60, step_s=60)
    assert diff is not None
    # window 1: nobody served (0); window 2: a sent nothing new but still wants its 600 (10/s),
    # got 0, and b got 10/s: a is behind by min(10 − 0, 10 − 0) = 10
    assert diff["max"] == pytest.approx(10.0)
    assert diff["mean"] == pytest.approx(5.0)


def test_unserved_demand_carries_forward_less_what_was_served() -> None:
    # a's one job (cost 600) is sent at 0 and decoded 30-90: 300 in each window; in the second
    # window it still wants the 300 not yet served and gets it (5/s): not behind b, who is
    # served 900/60 = 15/s there. A job finished before a window starts asks nothing of it.
    trace = [
        _attempt("a", 0, 300, 0.0, 30.0, 90.0),
        _attempt("a", 0, 300, 1.0, 2.0, 32.0),  # done at 32: no demand in the second window
        _attempt("b", 0, 450, 60.0, 60.0, 120.0),
    ]
    result = _result(_scenario(120), trace)
    diff = service_difference(result, window_s=60, step_s=60)
    assert diff is not None and diff["max"] == pytest.approx(0.0, abs=1e-9)


def test_a_tenant_that_asks_for_less_than_it_gets_is_not_counted_as_behind() -> None:
    assert window_difference({"a": 2.0, "b": 10.0}, {"a": 2.0, "b": 30.0}) == 0.0
    assert window_difference({"a": 2.0, "b": 10.0}, {"a": 5.0, "b": 30.0}) == 3.0
    assert window_difference({"a": 2.0}, {"a": 9.0}) == 0.0  # nobody to compare with


@given(st.lists(st.floats(0.01, 100), min_size=2, max_size=8))
def test_jain_is_one_exactly_when_everyone_got_the_same_multiple(xs: list[float]) -> None:
    from tokenpools.sim.fairness import jain

    value = jain(xs)
    assert value is not None and 1 / len(xs) - 1e-9 <= value <= 1 + 1e-9
    assert jain([xs[0]] * len(xs)) == pytest.approx(1.0)


jobs = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(1, 500),
        st.integers(1, 500),
        st.floats(0, 50),
        st.floats(0.1, 9),
    ),
    min_size=1,
    max_size=12,
)


@given(jobs)
def test_everyone_served_what_it_asked_within_the_window_is_perfectly_fair(
    drawn: list[tuple[str, int, int, float, float]],
) -> None:
    """Generated traces: every request sent and finished inside the one 60 s window: nobody
    is behind, and each got the same multiple (1) of what it asked for."""
    trace = [_attempt(t, p, o, sent, sent + d / 2, sent + d) for t, p, o, sent, d in drawn]
    result = _result(_scenario(60, ("c",)), trace)
    diff = service_difference(result)
    assert diff is not None and diff["max"] == pytest.approx(0.0, abs=1e-9)
    if len({t for t, *_ in drawn}) >= 2:
        assert entitled_jain_index(result) == pytest.approx(1.0)


def test_a_class_with_one_tenant_has_no_service_difference() -> None:
    scenario = _scenario(60)
    lone = scenario.model_copy(update={"tenants": scenario.tenants[:1]})
    assert service_difference(_result(lone, [_attempt("a", 1, 1, 0.0, 1.0, 2.0)])) is None
