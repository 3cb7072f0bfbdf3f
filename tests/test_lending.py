"""Who is lent what (control/eviction.py `is_lent`, control/plans.py `claims_once_measured`),
through the decision core: where the host suspends, spot work fills the unused protected
baselines and is taken back when an owner comes; a spot request the host cannot resume, or any
spot request where the host cannot suspend, keeps off them as before; an owner just bound
claims its baseline until it is first measured, on every kind of engine."""

from __future__ import annotations

import pytest

from tests.builders import make_config, store_named
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Reason, Reject
from tokenpools.model.request import RequestCost
from tokenpools.state.memory import MemoryStore

ENTS: list[dict[str, object]] = [
    {"name": "gold", "serviceClass": "guaranteed", "sloTargetMs": 1000, "concurrency": 4},
    {"name": "spot", "serviceClass": "spot"},
]
GOLD_BATCH: list[dict[str, object]] = [*ENTS[:1], {"name": "batch", "serviceClass": "preemptible"}]


def core(
    suspends: bool,
    scheduling: str = "priority",
    ents: list[dict[str, object]] = ENTS,
    **policy: object,
) -> DecisionCore:
    config = make_config(
        ents,
        concurrency=8,
        tokens_per_s=100000,
        policy={"backfillWindowS": 40, **policy},
        pool_extra={"schedulingPolicy": scheduling},
    )
    return DecisionCore(config, MemoryStore(), now=0.0, suspends=suspends)


def measured(c: DecisionCore) -> float:
    """Past the first update period: every owner measured (idle). Returns the time."""
    now = c.policy.update_period_s + 0.1
    c.tick(now)
    return now


def on_store(c: DecisionCore, store: str, request: pytest.FixtureRequest) -> DecisionCore:
    """The same core on the store named (memory: as it is; redis: a fresh key prefix)."""
    if store == "memory":
        return c
    return DecisionCore(c.config, store_named(store, request), now=0.0, suspends=True)


def fill(
    c: DecisionCore, name: str, resumable: bool, tries: int = 12, now: float = 1.0, tag: str = ""
) -> list[Admit]:
    admitted = []
    for i in range(tries):
        d = c.admit(name, RequestCost(100, 50, resumable=resumable), now, f"{name}{tag}-{i}")
        if isinstance(d, Admit):
            admitted.append(d)
    return admitted


def test_where_the_host_suspends_spot_fills_the_protected_baseline_and_gives_it_back() -> None:
    c = core(suspends=True)
    now = measured(c)
    spot = fill(c, "spot", resumable=True, now=now)
    assert len(spot) == 8  # the whole pool, gold's idle baseline included
    assert all(d.lease.preemptible for d in spot)
    gold = c.admit("gold", RequestCost(100, 50), now, "gold-0")
    assert isinstance(gold, Admit)
    assert [v.lease_id for v in gold.evict] == ["spot-7"]  # the newest lent request


@pytest.mark.parametrize(
    ("suspends", "resumable"),
    [(True, False), (False, True), (False, False)],
    ids=["cannot-resume", "host-does-not-suspend", "neither"],
)
def test_otherwise_spot_keeps_off_the_protected_baseline(suspends: bool, resumable: bool) -> None:
    c = core(suspends=suspends)
    spot = fill(c, "spot", resumable=resumable)
    assert len(spot) == 8 - 4  # gold's baseline stays free
    assert not any(d.lease.preemptible for d in spot)
    gold = [c.admit("gold", RequestCost(100, 50), 1.0, f"gold-{i}") for i in range(4)]
    assert all(isinstance(d, Admit) and not d.evict for d in gold)


def test_suspend_false_in_the_config_lends_as_without_suspension() -> None:
    c = core(suspends=True, suspend=False)
    assert len(fill(c, "spot", resumable=True)) == 4


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_an_owner_just_bound_claims_its_baseline(scheduling: str) -> None:
    """Gold has just bound: its claim is its whole baseline until measured, and a preemptible
    request leaves it free, whatever the engines' scheduling (a lent prefill in progress is
    not preempted for gold's first requests)."""
    c = core(True, scheduling, GOLD_BATCH)
    assert len(fill(c, "batch", resumable=True)) == 4


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
@pytest.mark.parametrize(("suspends", "most"), [(True, 8), (False, 6)])
def test_once_measured_an_owner_claims_nothing_where_taking_back_suspends(
    suspends: bool, most: int, scheduling: str
) -> None:
    """After its first update period gold is measured (idle). Where taking back suspends,
    its claim is gone and lent work fills the pool; where the host cannot suspend, the claim
    fades from the baseline and still holds room back."""
    c = core(suspends, scheduling, GOLD_BATCH)
    now = measured(c)
    admitted = len(fill(c, "batch", resumable=True, now=now))
    assert (admitted == 8) if suspends else (4 <= admitted <= most)


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_preemptible_work_the_host_cannot_end_is_never_lent(scheduling: str) -> None:
    """Envoy's ext_authz lets a request on and cannot stop it: a preemptible request admitted
    there keeps off the protected baselines (as spot work that cannot be suspended), is not
    preemptible in the store, and no protected request is admitted on the hope of ending it."""
    c = core(True, scheduling, GOLD_BATCH, backfillWindowS=0)
    kept = [
        c.admit("batch", RequestCost(100, 50, endable=False), 1.0, f"batch-{i}") for i in range(12)
    ]
    admitted = [d for d in kept if isinstance(d, Admit)]
    assert len(admitted) == 8 - 4  # gold's baseline stays free
    assert not any(d.lease.preemptible for d in admitted)
    gold = [c.admit("gold", RequestCost(100, 50), 1.0, f"gold-{i}") for i in range(4)]
    assert all(isinstance(d, Admit) and not d.evict for d in gold)
    # the same work from a host that ends it is lent the whole pool, and taken back
    c = core(True, scheduling, GOLD_BATCH, backfillWindowS=0)
    assert len(fill(c, "batch", resumable=False)) == 8
    gold0 = c.admit("gold", RequestCost(100, 50), 1.0, "gold-0")
    assert isinstance(gold0, Admit) and len(gold0.evict) == 1


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_lent_work_takes_room_a_request_was_refused_only_for_idle_baselines(
    store: str, request: pytest.FixtureRequest
) -> None:
    """Check 5 sheds lower-priority work for a higher-priority request's unmet demand. An
    elastic request refused only because the rest is gold's idle baseline cannot use that room
    whatever spot does, so spot, lent it, is not shed for it; once the pool itself is full,
    the elastic refusal counts again."""
    ents = [*ENTS[:1], {"name": "team", "serviceClass": "elastic", "sloTargetMs": 500},
            ENTS[1]]  # fmt: skip
    c = on_store(core(True, "priority", ents), store, request)
    now = measured(c)
    team = fill(c, "team", resumable=False, tries=6, now=now)
    assert len(team) == 8 - 4  # the rest is gold's
    assert len(fill(c, "spot", resumable=True, tries=2, now=now)) == 2  # 6 of 8: contended
    refused = c.admit("team", RequestCost(100, 50, resumable=False), now, "team-more")
    assert isinstance(refused, Reject) and refused.reason == Reason.POOL_FULL
    assert c.scores("team", now).priority > c.scores("spot", now).priority
    spot = fill(c, "spot", resumable=True, tries=4, now=now, tag="b")
    assert len(spot) == 2  # to the pool's 8, not shed for team
    refused = c.admit("team", RequestCost(100, 50, resumable=False), now, "team-full")
    assert isinstance(refused, Reject)  # the pool is full now: noted
    c.release(spot[0].lease.lease_id, now)
    shed = c.admit("spot", RequestCost(100, 50), now, "spot-shed")
    assert isinstance(shed, Reject) and shed.reason == Reason.LOW_PRIORITY


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_such_a_refusal_still_sheds_lower_priority_work_that_is_not_lent(
    store: str, request: pytest.FixtureRequest
) -> None:
    """The same refusal counts against work that is not lent: that work competes for the very
    room it was refused, and the slot a lower-priority elastic request frees goes to the
    higher-priority one."""
    ents = [*ENTS[:1], {"name": "team", "serviceClass": "elastic", "sloTargetMs": 500},
            {"name": "low", "serviceClass": "elastic", "sloTargetMs": 30000}]  # fmt: skip
    c = on_store(core(True, "priority", ents), store, request)
    now = measured(c)
    low = fill(c, "low", resumable=False, tries=2, now=now)
    assert len(low) == 2 and len(fill(c, "team", resumable=False, tries=2, now=now)) == 2
    refused = c.admit("team", RequestCost(100, 50, resumable=False), now, "team-more")
    assert isinstance(refused, Reject) and refused.reason == Reason.POOL_FULL  # gold's 4 held
    c.release(low[0].lease.lease_id, now)
    shed = c.admit("low", RequestCost(100, 50, resumable=False), now, "low-again")
    assert isinstance(shed, Reject) and shed.reason == Reason.LOW_PRIORITY
    assert isinstance(c.admit("team", RequestCost(100, 50), now, "team-again"), Admit)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_refusal_for_unreserved_tokens_sheds_lent_work_too(
    store: str, request: pytest.FixtureRequest
) -> None:
    """Tokens are not slots: lent work spends them from the same unreserved allowance an
    elastic request was refused, so that refusal counts in check 5 against lent work too,
    though the bucket itself still has room (lent work would otherwise draw it down, on the
    protected share it gives back, while the elastic tenant waits)."""
    ents = [*ENTS[:1], {"name": "team", "serviceClass": "elastic", "sloTargetMs": 500},
            ENTS[1]]  # fmt: skip
    config = make_config(
        ents, concurrency=100, tokens_per_s=1000,  # 10,000-token bucket; gold's share 400
        policy={"backfillWindowS": 40, "burstWindowS": 10, "overcommit": 0.0},
    )  # fmt: skip
    c = on_store(DecisionCore(config, MemoryStore(), now=0.0, suspends=True), store, request)
    now = measured(c)
    team = fill(c, "team", resumable=False, tries=100, now=now)
    refused = c.admit("team", RequestCost(100, 50, resumable=False), now, "team-more")
    assert isinstance(refused, Reject) and refused.reason == Reason.POOL_FULL
    assert refused.dimension == "throughput"
    pool = c.store.pool_counters("p", now)
    assert pool.bucket - pool.protected_bucket < 150 <= pool.bucket  # the bucket has room
    assert len(team) == int((10_000 - 400) / 150)
    assert c.scores("team", now).priority > c.scores("spot", now).priority
    shed = c.admit("spot", RequestCost(100, 50), now, "spot-shed")
    assert isinstance(shed, Reject) and shed.reason == Reason.LOW_PRIORITY
