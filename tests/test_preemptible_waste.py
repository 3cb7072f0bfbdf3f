"""Who may evict, what surplus work may fill, and check 5's margin (docs/decisions.md,
"Preemptible work that completes"), through the decision core on the memory store. The Redis
store runs the same comparisons: tests/test_store_differential.py draws every plan field and a
claim share, and sets claims through the scores. The family of generated scenarios these
rules are measured on is tests/test_preemptible_family.py."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from tests.builders import make_config
from tests.test_admission import BATCH, GUARANTEED, LITERAL, SMALL, SPOT, admit, reject
from tokenpools.control.backfill import (
    MAX_LENGTH_SHARE,
    SCALE_RANGE,
    claim_share,
    next_claim,
    rescaled,
)
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Reason, Reject
from tokenpools.control.eviction import may_evict
from tokenpools.control.store import Scores
from tokenpools.model.policy import Policy
from tokenpools.model.request import RequestCost, Usage
from tokenpools.model.service_class import ServiceClass
from tokenpools.state.memory import MemoryStore

ASSIST = {"name": "assist", "serviceClass": "elastic", "sloTargetMs": 3000, "concurrency": 4}
PROD = {"name": "prod", "serviceClass": "dedicated", "sloTargetMs": 1000, "concurrency": 4}
LONG = RequestCost(input_tokens=64, max_output_tokens=256)


def test_only_what_the_pool_owes_evicts() -> None:
    assert may_evict(ServiceClass.DEDICATED, 0.0) and may_evict(ServiceClass.GUARANTEED, -1.0)
    assert may_evict(ServiceClass.ELASTIC, 0.2)
    assert not may_evict(ServiceClass.ELASTIC, 0.0)  # served: takes free capacity only
    assert not may_evict(ServiceClass.ELASTIC, 0.005)  # the decaying tail of an old debt
    assert not may_evict(ServiceClass.SPOT, 1.0)
    assert not may_evict(ServiceClass.PREEMPTIBLE, 1.0)


def test_spot_waits_for_free_capacity_instead_of_evicting_preemptible_work() -> None:
    core = DecisionCore(make_config([SPOT, BATCH], policy=LITERAL), MemoryStore())
    batch = [admit(core, "batch", t=float(i)).lease for i in range(16)]
    refused = reject(core, "spot", t=16.0)
    assert refused.reason == Reason.POOL_FULL and refused.retry_after_s is not None
    assert all(core.store.get_lease(b.lease_id, 16.0) is not None for b in batch)
    core.settle(batch[0].lease_id, Usage(64, 64), 17.0)
    assert admit(core, "spot", t=17.0).evict == ()  # the freed slot


def test_elastic_evicts_once_its_debt_says_it_is_under_served() -> None:
    core = DecisionCore(make_config([ASSIST, BATCH], policy=LITERAL), MemoryStore())
    batch = [admit(core, "batch", t=0.1 * i).lease for i in range(16)]
    # Served so far (no debt): assist waits like everyone competing for free capacity.
    assert reject(core, "assist", t=2.0).reason == Reason.POOL_FULL
    assert reject(core, "assist", t=3.0).reason == Reason.POOL_FULL
    core.tick(5.0)  # the update period: assist asked and got nothing → debt
    assert core.store.scores("assist", 5.0).debt > 0.01
    d = admit(core, "assist", t=5.5)
    assert [v.lease_id for v in d.evict] == [batch[-1].lease_id]  # the newest batch lease


def test_a_protected_request_beyond_its_baseline_evicts_nothing() -> None:
    core = DecisionCore(make_config([PROD, BATCH], policy=LITERAL), MemoryStore())
    batch = [admit(core, "batch", t=0.0).lease for _ in range(16)]
    within = [admit(core, "prod", t=1.0) for _ in range(4)]  # its baseline: owed, evicts
    assert [len(d.evict) for d in within] == [1, 1, 1, 1]
    beyond = reject(core, "prod", t=1.0)  # a burst above it takes free capacity only
    assert beyond.reason == Reason.POOL_FULL
    assert sum(core.store.get_lease(b.lease_id, 1.0) is not None for b in batch) == 12


def claimed(core: DecisionCore, t: float) -> float:
    return core.store.pool_counters("p", t).claimed_concurrency


def test_surplus_work_leaves_the_others_claims_free_and_claims_fade_when_unused() -> None:
    core = DecisionCore(make_config([GUARANTEED, ASSIST, BATCH]), MemoryStore())
    # Just bound, nothing measured: gold and assist claim their whole baselines (6 + 4).
    assert claimed(core, 0.0) == 10
    first = admit(core, "gold", t=0.1)
    core.settle(first.lease.lease_id, Usage(64, 64), 0.2)  # the pool's typical output: 64
    # A request of the typical length leaves all the claims free: 16 − 10 slots.
    batch = [core.admit("batch", SMALL, 0.3) for _ in range(7)]
    assert [isinstance(d, Admit) for d in batch] == [True] * 6 + [False]
    assert isinstance(batch[-1], Reject) and batch[-1].reason == Reason.POOL_FULL
    # One 4× as long leaves MAX_LENGTH_SHARE of them free, times batch's scale (lowered a
    # little by each of its requests that completed).
    for d in batch[:6]:
        assert isinstance(d, Admit)
        core.settle(d.lease.lease_id, Usage(64, 64), 0.4)
    scale = core.pools["p"].claim_scale
    assert math.isclose(scale, rescaled(1.0, False, Policy()) ** 6)
    fits = 16 - math.floor(MAX_LENGTH_SHARE * scale * 10)
    assert sum(core.admit("batch", LONG, 0.5).admitted for _ in range(fits + 1)) == fits < 6
    # Quiet update periods: each claim fades towards the owner's mean in flight (~0 here)
    # with the time constant backfillWindowS (40 s): e^(−40/40) of it is left after 40 s.
    for t in range(5, 45, 5):
        core.tick(float(t))
    assert 10 * math.exp(-1) <= claimed(core, 40.0) <= 10 * math.exp(-1) + 0.1


def test_an_owner_that_comes_back_claims_its_peak_again() -> None:
    core = DecisionCore(make_config([GUARANTEED, BATCH]), MemoryStore())
    for t in range(5, 205, 5):
        core.tick(float(t))
    assert claimed(core, 200.0) < 0.1  # idle for long: its baseline is lent again
    gold = [admit(core, "gold", t=201.0) for _ in range(5)]
    for d in gold:
        core.settle(d.lease.lease_id, Usage(64, 64), 202.0)
    core.tick(205.0)
    assert core.store.scores("gold", 205.0).peak_concurrency == 5  # the period's peak
    assert claimed(core, 205.0) == 5


def test_evictions_make_preemptible_work_leave_more_free_and_completions_less() -> None:
    core = DecisionCore(make_config([PROD, BATCH], policy={"backfillWindowS": 40}), MemoryStore())
    for t in range(5, 405, 5):  # prod idle: its claim fades away
        core.tick(float(t))
    leases = [admit(core, "batch", t=401.0).lease for _ in range(16)]
    assert core.pools["p"].claim_scale == 1.0
    for _ in range(4):
        admit(core, "prod", t=402.0)
    raised = core.pools["p"].claim_scale
    assert raised == rescaled(rescaled(rescaled(rescaled(1.0, True, Policy()), True, Policy()),
                                       True, Policy()), True, Policy())  # fmt: skip
    assert raised > 2.0
    core.settle(leases[0].lease_id, Usage(64, 64), 403.0)
    assert core.pools["p"].claim_scale == rescaled(raised, False, Policy())


@given(
    scale=st.floats(*SCALE_RANGE),
    evictions=st.integers(0, 50),
    completions=st.integers(0, 200),
    target=st.floats(0.05, 0.95),
)
def test_the_scale_stays_in_range_and_balances_where_the_target_completes(
    scale: float, evictions: int, completions: int, target: float
) -> None:
    policy = Policy(preemptible_completion_target=target)
    s = scale
    for _ in range(evictions):
        s = rescaled(s, True, policy)
    for _ in range(completions):
        s = rescaled(s, False, policy)
    assert SCALE_RANGE[0] <= s <= SCALE_RANGE[1]
    # Where a share `target` of the requests complete, the scale moves nowhere on average.
    up, down = math.log(rescaled(1.0, True, policy)), math.log(rescaled(1.0, False, policy))
    assert up > 0 > down
    assert math.isclose((1 - target) * up + target * down, 0.0, abs_tol=1e-12)


@given(
    prev=st.tuples(st.floats(0, 64), st.floats(0, 64_000)),
    peak=st.tuples(st.floats(0, 64), st.floats(0, 64_000)),
    mean=st.tuples(st.floats(0, 64), st.floats(0, 64_000)),
    limit=st.sampled_from([(8.0, 8_000.0), (math.inf, math.inf)]),
)
def test_a_claim_covers_the_periods_peak_never_exceeds_the_limit_and_only_fades(
    prev: tuple[float, float],
    peak: tuple[float, float],
    mean: tuple[float, float],
    limit: tuple[float, float],
) -> None:
    policy = Policy()
    old = Scores(peak_concurrency=prev[0], peak_kv=prev[1])
    claim = next_claim(old, peak, mean, limit, policy)
    for i in range(2):
        assert claim[i] <= limit[i]
        assert claim[i] >= min(peak[i], limit[i])
        target = mean[i] * (1 + 2 / math.sqrt(mean[0])) if mean[0] > 0 else mean[i]
        # between the old claim and the target, unless the period's peak is higher
        assert claim[i] <= max(peak[i], prev[i], target) + 1e-9
    assert next_claim(old, peak, mean, limit, Policy(backfill_window_s=0)) == (0.0, 0.0)


def test_a_shorter_request_leaves_less_of_the_claims_free() -> None:
    assert claim_share(640, 0.0, 1.0) == 1.0  # nothing measured: as a typical one
    assert claim_share(32, 64, 1.0) == 0.5
    assert claim_share(1024, 64, 1.0) == MAX_LENGTH_SHARE
    assert claim_share(64, 64, 2.0) == 2.0


def test_backfill_window_0_claims_nothing() -> None:
    core = DecisionCore(
        make_config([GUARANTEED, BATCH], policy={"backfillWindowS": 0}), MemoryStore()
    )
    assert claimed(core, 0.0) == 0
    assert sum(core.admit("batch", LONG, 1.0).admitted for _ in range(17)) == 16


def test_check_5_treats_priorities_within_the_margin_as_equal() -> None:
    # priorities 36.5 and 30.7: within 20 % of each other, not within 10 %
    pair = [
        {"name": "copilot", "serviceClass": "elastic", "sloTargetMs": 1000, "concurrency": 5},
        {"name": "synth", "serviceClass": "elastic", "sloTargetMs": 1300, "concurrency": 5},
    ]

    def synth_after_copilot_refused(margin: float) -> Reason | None:
        policy = {"headroom": 0.25, "priorityMargin": margin}
        core = DecisionCore(make_config(pair, concurrency=8, policy=policy), MemoryStore())
        held = [admit(core, n) for n in ("copilot",) * 4 + ("synth",) * 4]
        assert reject(core, "copilot", t=0.5).reason == Reason.POOL_FULL
        core.release(held[0].lease.lease_id, 0.6)
        decision = core.admit("synth", SMALL, 0.7)
        return decision.reason if isinstance(decision, Reject) else None

    assert synth_after_copilot_refused(0.1) == Reason.LOW_PRIORITY
    assert synth_after_copilot_refused(0.2) is None
