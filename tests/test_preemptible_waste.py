"""Who may evict, what surplus work may borrow, and check 5's margin (docs/decisions.md,
"Preemptible work that completes"), through the decision core on the memory store. The
Redis store runs the same comparisons: tests/test_store_differential.py draws every plan
field, the backfill and margin ones included."""

from __future__ import annotations

from tests.builders import make_config
from tests.test_admission import BATCH, GUARANTEED, SMALL, SPOT, admit, reject
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Reason, Reject
from tokenpools.control.eviction import may_evict
from tokenpools.model.request import Usage
from tokenpools.model.service_class import ServiceClass
from tokenpools.state.memory import MemoryStore

ASSIST = {"name": "assist", "serviceClass": "elastic", "sloTargetMs": 3000, "concurrency": 4}


def test_only_what_the_pool_owes_evicts() -> None:
    assert may_evict(ServiceClass.DEDICATED, 0.0) and may_evict(ServiceClass.GUARANTEED, -1.0)
    assert may_evict(ServiceClass.ELASTIC, 0.2)
    assert not may_evict(ServiceClass.ELASTIC, 0.0)  # served: takes free capacity only
    assert not may_evict(ServiceClass.ELASTIC, 0.005)  # the decaying tail of an old debt
    assert not may_evict(ServiceClass.SPOT, 1.0)
    assert not may_evict(ServiceClass.PREEMPTIBLE, 1.0)


def test_spot_waits_for_free_capacity_instead_of_evicting_preemptible_work() -> None:
    core = DecisionCore(make_config([SPOT, BATCH]), MemoryStore())
    batch = [admit(core, "batch", t=float(i)).lease for i in range(16)]
    refused = reject(core, "spot", t=16.0)
    assert refused.reason == Reason.POOL_FULL and refused.retry_after_s is not None
    assert all(core.store.get_lease(b.lease_id, 16.0) is not None for b in batch)
    core.settle(batch[0].lease_id, Usage(64, 64), 17.0)
    assert admit(core, "spot", t=17.0).evict == ()  # the freed slot


def test_elastic_evicts_once_its_debt_says_it_is_under_served() -> None:
    core = DecisionCore(make_config([ASSIST, BATCH]), MemoryStore())
    batch = [admit(core, "batch", t=0.1 * i).lease for i in range(16)]
    # Served so far (no debt): assist waits like everyone competing for free capacity.
    assert reject(core, "assist", t=2.0).reason == Reason.POOL_FULL
    assert reject(core, "assist", t=3.0).reason == Reason.POOL_FULL
    core.tick(5.0)  # the update period: assist asked and got nothing → debt
    assert core.store.scores("assist", 5.0).debt > 0.01
    d = admit(core, "assist", t=5.5)
    assert [v.lease_id for v in d.evict] == [batch[-1].lease_id]  # the newest batch lease


def test_surplus_work_leaves_a_busy_owners_baseline_alone_until_it_has_been_quiet() -> None:
    policy = {"backfillWindowS": 20, "updatePeriodS": 5}
    core = DecisionCore(make_config([GUARANTEED, SPOT, BATCH], policy=policy), MemoryStore())
    core.tick(0.0)
    gold = [admit(core, "gold", t=1.0).lease for _ in range(6)]  # gold's peak: all 6
    for lease in gold:
        core.release(lease.lease_id, 2.0)
    core.tick(5.0)  # the period's peak (6 of 6) is now gold's recent peak: nothing lent
    assert core.store.scores("gold", 5.0).peak_concurrency == 6
    batch = 0
    while True:
        decision = core.admit("batch", SMALL, 6.0)
        if not decision.admitted:
            break
        batch += 1
    assert batch == 10  # 16 slots less gold's 6
    assert isinstance(decision, Reject) and decision.reason == Reason.POOL_FULL
    # spot borrows no more of gold's baseline than preemptible work, and evicts nothing
    assert reject(core, "spot", t=6.0).reason == Reason.POOL_FULL
    # Quiet periods fade the peak by 6 × 5 / 20 each; after 20 s all of it is lent again.
    for t in (10.0, 15.0, 20.0, 25.0):
        core.tick(t)
    assert core.store.scores("gold", 25.0).peak_concurrency == 0
    more = [core.admit("batch", SMALL, 25.5).admitted for _ in range(7)]
    assert more == [True] * 6 + [False]
    # gold coming back still gets its whole baseline, evicting the newest batch work
    assert all(admit(core, "gold", t=26.0).evict for _ in range(6))


def test_backfill_window_0_lends_every_idle_baseline() -> None:
    core = DecisionCore(
        make_config([GUARANTEED, BATCH], policy={"backfillWindowS": 0}), MemoryStore()
    )
    gold = [admit(core, "gold", t=1.0).lease for _ in range(6)]
    for lease in gold:
        core.release(lease.lease_id, 2.0)
    core.tick(5.0)
    assert sum(core.admit("batch", SMALL, 6.0).admitted for _ in range(17)) == 16


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
