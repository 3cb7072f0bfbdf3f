"""Admission decisions, one behaviour per test, through DecisionCore and the memory store."""

from __future__ import annotations

import pytest

from tests.builders import make_config
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Check, Reason, Reject
from tokenpools.model.config import Config, parse_config
from tokenpools.model.request import RequestCost, Usage
from tokenpools.model.resources import Resources
from tokenpools.state.memory import MemoryStore

SMALL = RequestCost(input_tokens=64, max_output_tokens=64)  # 128 tokens, 128 KV tokens


def admit(core: DecisionCore, name: str, t: float = 0.0, cost: RequestCost = SMALL) -> Admit:
    decision = core.admit(name, cost, t)
    assert isinstance(decision, Admit), decision
    return decision


def reject(core: DecisionCore, name: str, t: float = 0.0, cost: RequestCost = SMALL) -> Reject:
    decision = core.admit(name, cost, t)
    assert isinstance(decision, Reject), decision
    return decision


def assert_idle(core: DecisionCore) -> None:
    for pool in core.pools:
        c = core.store.pool_counters(pool, 0.0)
        assert (c.concurrency, c.kv_tokens, c.leases) == (0, 0, 0)
        assert (c.preemptible_concurrency, c.preemptible_kv) == (0, 0)
    for name in core.entitlements:
        e = core.store.entitlement_counters(name, 0.0)
        assert (e.concurrency, e.kv_tokens, e.leases) == (0, 0, 0)


GUARANTEED = {"name": "gold", "serviceClass": "guaranteed", "sloTargetMs": 1000, "concurrency": 6}
SPOT = {"name": "spot", "serviceClass": "spot", "sloTargetMs": 30000}
BATCH = {"name": "batch", "serviceClass": "preemptible"}


def test_admit_then_settle_refunds_and_returns_every_counter_to_zero() -> None:
    core = DecisionCore(make_config([GUARANTEED], policy={"burstWindowS": 10}), MemoryStore())
    d = admit(core, "gold")
    assert d.lease.tokens == 128 and d.lease.kv_tokens == 128 and not d.evict
    ent = core.store.entitlement_counters("gold", 0.0)
    assert (ent.concurrency, ent.kv_tokens) == (1, 128)
    assert ent.bucket == pytest.approx(180 * 10 - 128)
    assert core.settle(d.lease.lease_id, Usage(64, 10), 1.0) is d.lease
    assert core.settle(d.lease.lease_id, Usage(64, 10), 1.0) is None  # settles once
    assert_idle(core)
    # Only the 74 tokens really used stay charged: 1 s of refill at 180 tok/s tops it up.
    assert core.store.entitlement_counters("gold", 1.0).bucket == pytest.approx(1800)


def test_missing_max_tokens_gets_the_entitlement_default() -> None:
    core = DecisionCore(make_config([{**GUARANTEED, "defaultMaxTokens": 100}]), MemoryStore())
    d = admit(core, "gold", cost=RequestCost(input_tokens=20))
    assert d.lease.tokens == 120 and d.lease.kv_tokens == 120


def test_n_sequences_reserve_n_times_the_output_over_one_shared_prompt() -> None:
    core = DecisionCore(make_config([{**GUARANTEED, "defaultMaxTokens": 100}]), MemoryStore())
    d = admit(core, "gold", cost=RequestCost(input_tokens=20, max_output_tokens=50, sequences=3))
    assert d.lease.tokens == 20 + 3 * 50 and d.lease.kv_tokens == 20 + 3 * 50
    d = admit(core, "gold", cost=RequestCost(input_tokens=20, sequences=2))  # the default
    assert d.lease.tokens == 20 + 2 * 100
    with pytest.raises(ValueError, match="sequences"):
        RequestCost(input_tokens=20, sequences=0)


def test_guaranteed_concurrency_is_its_baseline_and_retry_after_is_computed() -> None:
    core = DecisionCore(make_config([GUARANTEED]), MemoryStore())
    for _ in range(6):
        admit(core, "gold")
    r = reject(core, "gold")
    assert (r.reason, r.check) == (Reason.CONCURRENCY_LIMIT, Check.CONCURRENCY)
    assert r.retry_after_s is not None and 1.0 <= r.retry_after_s <= 60.0


def test_guaranteed_throughput_is_rate_limited_by_its_own_bucket() -> None:
    # 180 tok/s, depth 1800: with 1000-token requests the second cannot fit at once.
    core = DecisionCore(make_config([GUARANTEED], policy={"burstWindowS": 10}), MemoryStore())
    big = RequestCost(input_tokens=500, max_output_tokens=500)
    admit(core, "gold", cost=big)
    r = reject(core, "gold", cost=big)
    assert (r.reason, r.check) == (Reason.THROUGHPUT_LIMIT, Check.THROUGHPUT)
    # 200 missing tokens at 180 tok/s ≈ 1.1 s, ± 20 % jitter
    assert r.retry_after_s == pytest.approx(200 / 180, rel=0.21)
    admit(core, "gold", t=200 / 180 + 0.01, cost=big)


def test_kv_entitlement_is_checked_separately_from_concurrency() -> None:
    core = DecisionCore(make_config([{**GUARANTEED, "kvTokens": 1000}]), MemoryStore())
    long = RequestCost(input_tokens=400, max_output_tokens=100)
    admit(core, "gold", cost=long)
    admit(core, "gold", cost=long)
    r = reject(core, "gold", cost=long)
    assert (r.reason, r.check) == (Reason.KV_LIMIT, Check.KV)


def test_request_larger_than_the_pool_is_rejected_for_good() -> None:
    core = DecisionCore(make_config([SPOT], kv_tokens=4096), MemoryStore())
    r = reject(core, "spot", cost=RequestCost(input_tokens=4000, max_output_tokens=200))
    assert (r.reason, r.check, r.retry_after_s) == (Reason.EXCEEDS_POOL, Check.SIZE, None)
    assert "pool 'p'" in r.message
    assert_idle(core)


def test_request_larger_than_the_entitlement_is_rejected_for_good() -> None:
    core = DecisionCore(make_config([{**GUARANTEED, "kvTokens": 500}]), MemoryStore())
    r = reject(core, "gold", cost=RequestCost(input_tokens=400, max_output_tokens=200))
    assert (r.reason, r.retry_after_s) == (Reason.EXCEEDS_ENTITLEMENT, None)


def test_zero_capacity_pool_admits_nothing_and_binds_no_reserved_baseline() -> None:
    core = DecisionCore(make_config([GUARANTEED, SPOT], replicas=0), MemoryStore())
    assert core.entitlements["gold"].state == "Pending"
    assert reject(core, "gold").reason == Reason.ENTITLEMENT_PENDING
    assert reject(core, "spot").reason == Reason.EXCEEDS_POOL


def test_zero_baseline_guaranteed_can_never_be_admitted() -> None:
    core = DecisionCore(make_config([{**GUARANTEED, "concurrency": 0}]), MemoryStore())
    assert core.entitlements["gold"].state == "Bound"
    assert reject(core, "gold").reason == Reason.EXCEEDS_ENTITLEMENT


def test_unknown_entitlement() -> None:
    core = DecisionCore(make_config([GUARANTEED]), MemoryStore())
    r = reject(core, "nobody")
    assert (r.reason, r.check) == (Reason.UNKNOWN_ENTITLEMENT, Check.STATE)


def test_expired_entitlement_is_rejected_from_its_expiry_on() -> None:
    expiry = "2030-01-01T00:00:00Z"
    core = DecisionCore(
        make_config([{**GUARANTEED, "expiresAt": expiry}]), MemoryStore(), now=1.0e9
    )
    t_expiry = 1893456000.0
    admit(core, "gold", t=t_expiry - 1)
    r = reject(core, "gold", t=t_expiry)
    assert r.reason == Reason.ENTITLEMENT_EXPIRED
    assert core.entitlements["gold"].state == "Expired"


# The paper's rules alone: nothing claimed for what the others may take back soon (that rule
# is tests/test_preemptible_waste.py's).
LITERAL = {"backfillWindowS": 0}


def test_spot_never_sits_on_a_reserved_baseline() -> None:
    # 16 slots, gold reserves 6: spot gets the other 10, and gold its 6 without overcommit.
    core = DecisionCore(make_config([GUARANTEED, SPOT], policy=LITERAL), MemoryStore())
    admitted = 0
    while isinstance(core.admit("spot", SMALL, 0.0), Admit):
        admitted += 1
    assert admitted == 10
    decisions = [admit(core, "gold") for _ in range(6)]
    assert [d.overcommit for d in decisions] == [False] * 6
    assert core.store.pool_counters("p", 0.0).concurrency == 16


def test_protected_overcommit_after_capacity_is_lost_under_work_that_cannot_be_evicted() -> None:
    core = DecisionCore(make_config([GUARANTEED, SPOT], policy=LITERAL), MemoryStore())
    for _ in range(10):
        admit(core, "spot")
    core.set_capacity("p", 0.0, per_replica=Resources(480, 32768, 14))
    # 14 slots now, 10 held by spot (it drains): gold's baseline still admits, overcommitting
    # up to 14 × 1.1 = 15.4
    decisions = [core.admit("gold", SMALL, 1.0) for _ in range(6)]
    assert [isinstance(d, Admit) and d.overcommit for d in decisions] == [False] * 4 + [True] + [
        False
    ]
    assert isinstance(decisions[-1], Reject) and decisions[-1].reason == Reason.POOL_FULL


def test_preemptible_backfills_everything_and_is_evicted_lowest_newest_first() -> None:
    core = DecisionCore(make_config([GUARANTEED, BATCH], policy=LITERAL), MemoryStore())
    leases = [admit(core, "batch", t=float(i)).lease for i in range(16)]
    assert reject(core, "batch", t=16.0).reason == Reason.POOL_FULL
    d = admit(core, "gold", t=17.0)
    assert not d.overcommit
    assert [v.lease_id for v in d.evict] == [leases[-1].lease_id]  # the newest
    assert core.store.get_lease(leases[-1].lease_id, 17.0) is None
    assert core.store.pool_counters("p", 17.0).concurrency == 16


def test_spot_is_never_evicted() -> None:
    core = DecisionCore(make_config([GUARANTEED, SPOT, BATCH], policy=LITERAL), MemoryStore())
    for _ in range(10):
        admit(core, "spot")
    assert all(not admit(core, "gold").evict for _ in range(6))


ELASTIC_PAIR = [
    {"name": "copilot", "serviceClass": "elastic", "sloTargetMs": 500, "concurrency": 5},
    {"name": "synth", "serviceClass": "elastic", "sloTargetMs": 30000, "concurrency": 5},
]


def test_near_full_pool_sheds_the_lower_priority_tenant_only_for_unmet_demand_above_it() -> None:
    core = DecisionCore(
        make_config(ELASTIC_PAIR, concurrency=8, policy={"headroom": 0.25}), MemoryStore()
    )
    # Alone in the pool, synth fills it to capacity: a tenant never blocks itself.
    synth = [admit(core, "synth") for _ in range(8)]
    for d in synth[:4]:
        core.release(d.lease.lease_id, 0.0)
    admit(core, "copilot")
    admit(core, "synth")
    # Near full (above 6 of 8), but copilot wants nothing more: synth is not shed.
    admit(core, "synth")
    admit(core, "copilot")
    full = reject(core, "copilot", t=1.0)  # copilot's demand is now unmet
    assert full.reason == Reason.POOL_FULL
    core.release(synth[4].lease.lease_id, 1.0)
    r = reject(core, "synth", t=1.5)
    assert (r.reason, r.check) == (Reason.LOW_PRIORITY, Check.PRIORITY)
    assert r.retry_after_s is not None
    admit(core, "copilot", t=1.5)  # copilot takes the slot synth was refused
    core.release(synth[5].lease.lease_id, 4.0)
    # Beyond the contention window copilot's refusal is forgotten: synth may backfill again.
    admit(core, "synth", t=4.0)


def test_check_5_sheds_the_lowest_priority_in_flight_not_the_middle() -> None:
    three = [
        *ELASTIC_PAIR,
        {"name": "reports", "serviceClass": "elastic", "sloTargetMs": 5000, "concurrency": 5},
    ]
    policy = {"headroom": 0.25, "elasticOversubscription": 2}
    core = DecisionCore(make_config(three, concurrency=8, policy=policy), MemoryStore())
    held = [admit(core, n) for n in ("copilot",) * 4 + ("synth",) * 2 + ("reports",) * 2]
    assert reject(core, "copilot", t=0.5).reason == Reason.POOL_FULL
    core.release(held[0].lease.lease_id, 0.6)
    # copilot (93.8) is refused; of the others in flight synth (20.3) is the lowest, so
    # reports (60.4) passes check 5 and synth does not.
    assert reject(core, "synth", t=0.7).reason == Reason.LOW_PRIORITY
    admit(core, "reports", t=0.7)


def test_capacity_shrink_evicts_preemptible_and_admits_nothing_beyond_it() -> None:
    core = DecisionCore(make_config([SPOT, BATCH], replicas=2, concurrency=8), MemoryStore())
    batch = [admit(core, "batch", t=float(i)).lease for i in range(8)]
    for i in range(8):  # spot outranks batch, so the contended half is no obstacle
        admit(core, "spot", t=10.0 + i)
    change = core.set_replicas("p", 1, 20.0)
    assert sorted(v.lease_id for v in change.evict) == sorted(b.lease_id for b in batch)
    assert core.store.pool_counters("p", 20.0).concurrency == 8
    assert reject(core, "spot", t=20.0).reason == Reason.POOL_FULL
    grown = core.set_replicas("p", 2, 21.0)
    assert grown.evict == ()
    admit(core, "spot", t=21.0)


def test_shrink_degrades_what_no_longer_fits_and_grow_rebinds_it() -> None:
    a = {**GUARANTEED, "name": "a"}
    b = {**GUARANTEED, "name": "b"}
    core = DecisionCore(make_config([a, b], concurrency=8, replicas=2), MemoryStore())
    assert {n: v.state for n, v in core.entitlements.items()} == {"a": "Bound", "b": "Bound"}
    change = core.set_replicas("p", 1, 1.0)
    assert change.states == {"b": "Degraded"}
    assert reject(core, "b", t=1.0).reason == Reason.ENTITLEMENT_DEGRADED
    admit(core, "a", t=1.0)
    assert core.set_replicas("p", 2, 2.0).states == {"b": "Bound"}
    admit(core, "b", t=2.0)


def test_pending_when_a_newcomer_does_not_fit_and_bound_ones_keep_their_place() -> None:
    a = {**GUARANTEED, "name": "a", "concurrency": 10}
    b = {**GUARANTEED, "name": "b", "concurrency": 10}
    core = DecisionCore(make_config([a, b]), MemoryStore())
    assert core.entitlements["a"].state == "Bound"
    assert core.entitlements["b"].state == "Pending"
    # Reordering the config does not unseat the bound one.
    core.apply_config(make_config([b, a]), 1.0)
    assert core.entitlements["a"].state == "Bound"
    assert core.entitlements["b"].state == "Pending"


def test_lost_lease_expires_and_its_capacity_comes_back() -> None:
    core = DecisionCore(make_config([SPOT], policy={"leaseTtlS": 30}), MemoryStore())
    d = admit(core, "spot")
    assert core.tick(29.0).expired == ()
    result = core.tick(30.0)
    assert [x.lease_id for x in result.expired] == [d.lease.lease_id]
    assert_idle(core)
    assert core.settle(d.lease.lease_id, Usage(1, 1), 31.0) is None


def test_renew_keeps_a_long_request_alive() -> None:
    core = DecisionCore(make_config([SPOT], policy={"leaseTtlS": 30}), MemoryStore())
    d = admit(core, "spot")
    assert core.renew(d.lease.lease_id, 20.0)
    assert core.tick(30.0).expired == ()
    assert len(core.tick(50.0).expired) == 1


def test_duplicate_request_id_is_refused() -> None:
    core = DecisionCore(make_config([SPOT]), MemoryStore())
    assert isinstance(core.admit("spot", SMALL, 0.0, request_id="x"), Admit)
    with pytest.raises(ValueError, match="already holds a lease"):
        core.admit("spot", SMALL, 0.0, request_id="x")
    assert core.store.pool_counters("p", 0.0).concurrency == 1


def test_bad_costs_and_usage_raise_before_touching_state() -> None:
    with pytest.raises(ValueError, match="input_tokens"):
        RequestCost(input_tokens=-1)
    with pytest.raises(ValueError, match="max_output_tokens"):
        RequestCost(input_tokens=1, max_output_tokens=-1)
    with pytest.raises(ValueError, match="usage"):
        Usage(-1, 3)


def test_an_embedding_reserves_its_input_and_no_output() -> None:
    core = DecisionCore(make_config([GUARANTEED]), MemoryStore())
    decision = core.admit("gold", RequestCost(input_tokens=300, max_output_tokens=0), 0.0)
    assert isinstance(decision, Admit) and decision.max_tokens == 0
    assert decision.lease.kv_tokens == 300  # not the default output ceiling on top
    unset = core.admit("gold", RequestCost(input_tokens=300), 0.0)
    assert isinstance(unset, Admit) and unset.lease.kv_tokens > 300


def test_retry_after_is_jittered_per_request_and_deterministic() -> None:
    core = DecisionCore(make_config([GUARANTEED]), MemoryStore())
    for _ in range(6):
        admit(core, "gold")
    waits = {reject(core, "gold").retry_after_s for _ in range(20)}
    assert len(waits) > 5  # spread, not a herd
    again = DecisionCore(make_config([GUARANTEED]), MemoryStore())
    for _ in range(6):
        admit(again, "gold")
    assert {reject(again, "gold").retry_after_s for _ in range(20)} == waits


def test_removed_entitlement_returns_its_leases_for_the_host_to_end() -> None:
    core = DecisionCore(make_config([GUARANTEED, SPOT]), MemoryStore())
    d = admit(core, "spot")
    admit(core, "gold")
    ended = core.apply_config(make_config([GUARANTEED]), 1.0)
    assert [x.lease_id for x in ended] == [d.lease.lease_id]
    assert core.store.pool_counters("p", 1.0).concurrency == 1
    assert reject(core, "spot").reason == Reason.UNKNOWN_ENTITLEMENT


def test_api_key_lookup_uses_hashes() -> None:
    from tokenpools.control.tenancy import Caller, Directory
    from tokenpools.model.keys import hash_key

    directory = Directory(make_config([{**SPOT, "apiKeys": [hash_key("sk-secret")]}]))
    key = directory.by_key("sk-secret", 0.0)
    assert isinstance(key, Caller) and key.entitlement == "spot"  # on an entitlement: that one
    assert directory.by_key("sk-other", 0.0) is None


def test_reload_moving_an_entitlement_to_another_pool_ends_its_leases() -> None:

    def config(pool: str) -> Config:
        replica = {"tokensPerSecond": 480, "kvTokens": 32768, "concurrency": 16}
        return parse_config(
            {
                "pools": [
                    {"name": "a", "model": "Qwen3-8B", "perReplica": replica},
                    {"name": "b", "model": "Qwen3-8B", "perReplica": replica},
                ],
                "entitlements": [
                    {
                        "name": "g",
                        "tenantId": "t",
                        "pool": pool,
                        "serviceClass": "guaranteed",
                        "concurrency": 4,
                    }
                ],
            }
        )

    core = DecisionCore(config("a"), MemoryStore())
    d = admit(core, "g")
    ended = core.apply_config(config("b"), 1.0)
    assert [x.lease_id for x in ended] == [d.lease.lease_id]
    for pool in ("a", "b"):
        c = core.store.pool_counters(pool, 1.0)
        assert (c.concurrency, c.kv_tokens) == (0, 0)
    assert core.store.pool_counters("b", 1.0).holdback_concurrency == 4
    assert core.store.pool_counters("a", 1.0).holdback_concurrency == 0
    assert admit(core, "g", t=1.0).lease.pool == "b"


def test_over_served_elastic_tenant_earns_credit_and_loses_priority() -> None:
    elastic = {"name": "e", "serviceClass": "elastic", "sloTargetMs": 1000, "concurrency": 2}
    core = DecisionCore(make_config([elastic]), MemoryStore())  # λ_e = 2/16 × 480 = 60 tok/s
    start = core.entitlements["e"].priority
    t = 0.0
    core.tick(t)
    for _ in range(10):  # settles 10 × 128 tokens per 5 s period: 256 tok/s on a 60 baseline
        for _ in range(10):
            d = admit(core, "e", t=t)
            core.settle(d.lease.lease_id, Usage(64, 64), t)
        t += 5.0
        core.tick(t)
    scores = core.store.scores("e", t)
    assert -1.0 <= scores.debt < -0.9  # demand-capped gap: (60 − 256)/60 clamped to −1
    assert scores.burst > 2.0  # (256/60 − 1) in throughput
    assert core.entitlements["e"].priority < start / 10


def test_entitlement_expiry_is_applied_by_tick() -> None:
    expiry = "2030-01-01T00:00:00Z"
    t_expiry = 1893456000.0
    core = DecisionCore(
        make_config([{**GUARANTEED, "expiresAt": expiry}, SPOT]), MemoryStore(), now=1.0e9
    )
    assert core.tick(t_expiry - 1).states_changed == {}
    assert core.tick(t_expiry).states_changed == {"gold": "Expired"}
    assert core.store.pool_counters("p", t_expiry).holdback_concurrency == 0
