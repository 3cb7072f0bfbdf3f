"""Lent entitlements of equal priority take turns being taken back first (control/eviction.py
`turn`, control/catalog.py `arrange_surplus`): a fixed order took back the same tenant again
and again, one update period after another."""

from __future__ import annotations

from collections import Counter

from tests.builders import make_config
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.control.eviction import turn
from tokenpools.model.request import RequestCost
from tokenpools.state.memory import MemoryStore

NAMES = [f"batch-{i}" for i in range(8)]


def test_each_of_equal_entitlements_goes_first_about_as_often() -> None:
    first = Counter(min(NAMES, key=lambda n: turn(period, n)) for period in range(4000))
    assert set(first) == set(NAMES)
    assert all(350 <= first[n] <= 650 for n in NAMES), first  # 500 each expected


def test_owners_take_back_every_equal_tenant_in_turn_the_same_on_every_replica() -> None:
    ents = [
        {"name": "gold", "serviceClass": "guaranteed", "sloTargetMs": 1000, "concurrency": 4},
        *({"name": n, "serviceClass": "preemptible"} for n in NAMES[:4]),
    ]
    config = make_config(ents, concurrency=8, tokens_per_s=100000)
    store = MemoryStore()  # two gateway replicas on one store
    replicas = [DecisionCore(config, store, now=0.0, suspends=True) for _ in range(2)]
    period = replicas[0].policy.update_period_s
    taken: Counter[str] = Counter()
    for k in range(1, 41):
        now = k * period + 0.1
        for core in replicas:  # a host ticks more often than once a period: the replica
            core.tick(now - 0.05)  # that did not update the scores reads them next tick
            core.tick(now)
        for i, name in enumerate(NAMES[:4] * 2):  # two lent requests each fill the pool
            replicas[0].admit(name, RequestCost(100, 50), now, f"{name}-{k}-{i}")
        picks = []
        for r, core in enumerate(replicas):  # each replica's owner request takes one back
            d = core.admit("gold", RequestCost(100, 50), now, f"gold-{k}-{r}")
            assert isinstance(d, Admit) and len(d.evict) == 1
            picks.append(d.evict[0].entitlement)
            core.release(d.lease.lease_id, now)
            replicas[0].admit(NAMES[0], RequestCost(100, 50), now, f"refill-{k}-{r}")
        # the same tenant first on both replicas, its newest lease first
        assert picks[0] == picks[1]
        taken[picks[0]] += 1
        for lease in list(store.leases.values()):  # an empty pool for the next period
            store.release(lease.lease_id, now)
    assert set(taken) == set(NAMES[:4]) and max(taken.values()) <= 20, taken


def test_a_turn_is_the_same_in_every_process() -> None:
    """Replicas are separate processes: the turn is CRC-32 of the period and the name, not
    Python's per-process salted hash."""
    assert [turn(p, n) for p, n in ((0, "batch-0"), (1, "batch-0"), (7, "spot"))] == [
        1715664067,
        1899618432,
        3680146430,
    ]
