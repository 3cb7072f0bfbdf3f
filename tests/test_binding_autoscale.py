"""Binding order and the autoscaler's arithmetic, from the capacity model admission uses."""

from __future__ import annotations

import pytest

from tests.builders import make_config
from tokenpools.control.autoscale import capacity_need, desired_replicas
from tokenpools.control.binding import bind
from tokenpools.control.core import DecisionCore
from tokenpools.control.observation import Observation
from tokenpools.model.entitlement import BindingState
from tokenpools.model.request import RequestCost
from tokenpools.model.resources import Resources
from tokenpools.state.memory import MemoryStore

BOUND, PENDING = BindingState.BOUND, BindingState.PENDING


def ent(name: str, cls: str, slots: float, **extra: object) -> dict[str, object]:
    return {"name": name, "serviceClass": cls, "concurrency": slots, **extra}


def test_dedicated_never_displaces_a_bound_guaranteed_entitlement() -> None:
    config = make_config([ent("d", "dedicated", 10), ent("g", "guaranteed", 10),
                          ent("e", "elastic", 4)])  # fmt: skip
    ents, pool = list(config.entitlements.values()), config.pools["p"]
    states = bind(pool, ents, {"g": BOUND}, config.policy, 0.0)
    assert states == {"d": PENDING, "g": BOUND, "e": BOUND}  # it waits, FIFO with guaranteed
    # … but it still goes ahead of every lower class, and binds once the room is free
    crowded = make_config([ent("d", "dedicated", 10), ent("e", "elastic", 15)])
    ents = list(crowded.entitlements.values())
    states = bind(crowded.pools["p"], ents, {"e": BOUND}, crowded.policy, 0.0)
    assert states == {"d": BOUND, "e": BindingState.DEGRADED}  # 10 + 15 > 16 × 1.5


def test_a_baseline_must_fit_in_every_dimension() -> None:
    # 4 slots fit, but 20,000 KV tokens do not fit next to the first one's 16,384.
    config = make_config([ent("a", "guaranteed", 8), ent("b", "guaranteed", 4, kvTokens=20000)])
    states = bind(config.pools["p"], list(config.entitlements.values()), {}, config.policy, 0.0)
    assert states == {"a": BOUND, "b": PENDING}


def test_elastic_binds_up_to_the_oversubscription_and_spot_always_binds() -> None:
    entitlements = [
        ent("g", "guaranteed", 8),
        ent("e1", "elastic", 8),
        ent("e2", "elastic", 8),  # 24 of 16 × 1.5 = 24: fits exactly
        ent("e3", "elastic", 1),
        ent("s", "spot", 0),
        ent("x", "preemptible", 0),
    ]
    config = make_config(entitlements)
    states = bind(config.pools["p"], list(config.entitlements.values()), {}, config.policy, 0.0)
    assert states == {"g": BOUND, "e1": BOUND, "e2": BOUND, "e3": PENDING, "s": BOUND, "x": BOUND}


def test_desired_replicas_counts_reserved_baselines_and_demanded_elastic_share() -> None:
    config = make_config(
        [ent("g", "guaranteed", 12), ent("e", "elastic", 16), ent("s", "spot", 0)],
        policy={"elasticOversubscription": 4},
    )
    pool = config.pools["p"]
    ents = list(config.entitlements.values())
    idle = capacity_need(ents, {})
    assert idle == Resources(360.0, 24576.0, 12.0)  # guaranteed only: 12 of 16 slots
    assert desired_replicas(pool, idle) == 1
    busy = {"e": Observation(Resources(), demand_tokens_per_s=480.0)}  # all of its 480
    assert capacity_need(ents, busy).concurrency == 28
    assert desired_replicas(pool, capacity_need(ents, busy)) == 2
    half = {"e": Observation(Resources(), demand_tokens_per_s=240.0)}
    assert capacity_need(ents, half).concurrency == 20
    spot_storm = {"s": Observation(Resources(), demand_tokens_per_s=1e6)}
    assert capacity_need(ents, spot_storm) == idle  # spot never scales the pool


def test_desired_replicas_is_clamped_to_the_pool_bounds() -> None:
    config = make_config([ent("g", "guaranteed", 16)], pool_extra={"minReplicas": 1})
    pool = config.pools["p"]  # maxReplicas = 8 in the builder
    assert desired_replicas(pool, Resources(concurrency=1000)) == 8
    assert desired_replicas(pool, Resources()) == 1


def test_core_reports_desired_replicas_from_observed_demand() -> None:
    config = make_config(
        [ent("g", "guaranteed", 8), ent("e", "elastic", 16)],
        policy={"elasticOversubscription": 2},
    )
    core = DecisionCore(config, MemoryStore())
    assert core.desired_replicas("p") == 1  # 8 slots reserved, elastic idle
    t = 0.0
    core.tick(t)
    for _ in range(3):  # elastic asks for 2× its 480 tok/s baseline
        for _ in range(40):
            core.admit("e", RequestCost(60, 60), t)
        t += 5.0
        core.tick(t)
    assert core.observations["e"].demand_tokens_per_s == pytest.approx(960.0)
    assert core.desired_replicas("p") == 2  # 8 + 16 slots of need over 16 per replica


def test_hysteresis_waits_for_sustained_need_before_acting() -> None:
    from tokenpools.control.autoscale import Hysteresis

    rule = Hysteresis(up_after_s=15, down_after_s=120)
    assert rule.step(1, 1, 3, now=0) == 0  # one noisy period buys nothing
    assert rule.step(1, 1, 1, now=5) == 0  # ... and the need went away: the clock restarts
    assert rule.step(1, 1, 3, now=10) == 0
    assert rule.step(1, 1, 3, now=20) == 0
    assert rule.step(1, 1, 3, now=25) == 2  # above for 15 s: ask for the difference
    assert rule.step(3, 1, 3, now=30) == 0  # starting replicas count as provisioned
    # below what serves, with nothing starting: one replica per full delay
    assert rule.step(3, 3, 1, now=100) == 0
    assert rule.step(3, 3, 1, now=219) == 0
    assert rule.step(3, 3, 1, now=220) == -1
    assert rule.step(2, 2, 1, now=300) == 0
    assert rule.step(2, 2, 1, now=340) == -1
