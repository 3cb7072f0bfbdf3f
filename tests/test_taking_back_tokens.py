"""Lent work and the pool's token bucket (control/eviction.py `refund_when_taken` and
`choose_victims`, state/checks.py and its Lua port): where taking back suspends, lent work may
draw on the protected share of the bucket as far as the lent work in flight would give it back
(the bucket, with what taking back the lent work gives back, always covers the protected share
less the overcommit), and an owner's request within its baseline that finds the bucket short
takes lent work back for tokens, as it does for slots and KV: each suspended lease gives its
whole reservation back. Lent work that taking back would end gives none back: it never draws
on the share, and is never taken for tokens. Checked on generated pools, on the memory store
and on Redis, against an oracle written from that rule and the store's counters."""

from __future__ import annotations

import random
import secrets
from dataclasses import fields
from typing import Any

import pytest

from tests.builders import make_config, store_named
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Reject
from tokenpools.control.eviction import eviction_order
from tokenpools.control.retry import expected_wait_s
from tokenpools.control.store import (
    INF,
    BucketSpec,
    EntitlementCounters,
    PoolCounters,
    ReservePlan,
    Shortfall,
    Store,
)
from tokenpools.model.request import RequestCost
from tokenpools.model.resources import Resources
from tokenpools.state.memory import MemoryStore

SLOTS = 64  # neither slots nor KV bind here: only tokens
KV_PER_SLOT = 4000


def generated(rng: random.Random) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A pool's policy and capacity, one owner and one lent tenant."""
    setup = {
        "tokens_per_s": rng.choice([400, 800, 1200]),
        "policy": {"burstWindowS": rng.choice([5, 10]), "overcommit": rng.choice([0.0, 0.1])},
    }
    base = rng.randint(2, 6)
    ents = [
        {"name": "owner", "serviceClass": rng.choice(["guaranteed", "dedicated"]),
         "sloTargetMs": 1000, "concurrency": base},
        {"name": "lent", "serviceClass": rng.choice(["preemptible", "spot"])},
    ]  # fmt: skip
    return setup, ents


def make_core(setup: dict[str, Any], ents: list[dict[str, Any]], store: Store) -> DecisionCore:
    config = make_config(
        ents, concurrency=SLOTS, kv_tokens=SLOTS * KV_PER_SLOT, tokens_per_s=setup["tokens_per_s"],
        policy=setup["policy"],
    )  # fmt: skip
    return DecisionCore(config, store, now=0.0, suspends=True)


def covered(c: PoolCounters) -> float:
    """What covers the protected share: the bucket and what lent work would give back."""
    return c.bucket + c.reclaimable_tokens - c.protected_bucket


def check_pool(seed: int, store: Store) -> tuple[int, bool]:
    """How many leases were taken back for tokens, and whether lent work drew on the
    protected share."""
    rng = random.Random(seed)
    setup, ents = generated(rng)
    core = make_core(setup, ents, store)
    now = core.policy.update_period_s + 0.1
    core.tick(now)  # past the first period: the owner is measured (idle)
    rate = setup["tokens_per_s"]
    depth = rate * setup["policy"]["burstWindowS"]
    lend = setup["policy"]["overcommit"] * depth

    # Lent work, at one instant (nothing refills): it fills the bucket, the protected share
    # included as far as it gives it back; work that taking back would end gives none back.
    refusals, drew = 0, False
    for i in range(400):
        if refusals >= 15:
            break
        prompt, out = rng.randint(50, 400), rng.randint(100, 800)
        resumable = rng.random() < 0.7
        before = store.pool_counters("p", now)
        d = core.admit("lent", RequestCost(prompt, out, resumable=resumable), now, f"lent-{i}")
        after = store.pool_counters("p", now)
        tokens = prompt + out
        if isinstance(d, Reject):  # the bucket itself, or the share not covered, stops it
            refusals += 1
            assert before.bucket < tokens or covered(before) - tokens < -lend + 1e-6, before
        else:
            gave = tokens if resumable else 0.0
            assert covered(after) == pytest.approx(covered(before) - tokens + gave)
            drew = drew or after.bucket < after.protected_bucket
        assert covered(after) >= -lend - 1e-6, after
    lent_leases = store.preemptible_leases("p", now).get("lent", {})
    assert lent_leases, "no lent work admitted"

    # The owner, within its baseline: it finds the bucket short and takes back what it needs.
    own_depth = rate * ents[0]["concurrency"] / SLOTS * setup["policy"]["burstWindowS"]
    size = int(own_depth / ents[0]["concurrency"])
    taken = 0
    for j in range(ents[0]["concurrency"]):
        before = store.pool_counters("p", now)
        groups = store.preemptible_leases("p", now)
        need = size - before.bucket
        expected: list[str] = []
        freed = 0.0
        for lease in eviction_order(groups, ["lent"]):
            if need - freed <= 0:
                break
            if lease.resumable:
                expected.append(lease.lease_id)
                freed += lease.tokens
        d = core.admit("owner", RequestCost(size // 2, size - size // 2), now, f"owner-{j}")
        after = store.pool_counters("p", now)
        if need <= 0:
            assert isinstance(d, Admit) and not d.evict
            assert after.bucket == pytest.approx(before.bucket - size)
        elif freed >= need and min(depth, before.bucket + freed) - size >= 0:
            assert isinstance(d, Admit), d
            assert [v.lease_id for v in d.evict] == expected  # newest first, resumable only
            assert after.bucket == pytest.approx(min(depth, before.bucket + freed) - size)
            assert all(store.get_lease(lid, now) is None for lid in expected)
            taken += len(expected)
        elif before.bucket - size >= -lend:  # not enough to take back: it overcommits
            assert isinstance(d, Admit) and d.overcommit and not d.evict, d
            assert after.bucket == pytest.approx(before.bucket - size)
        else:  # refused, and nothing taken back
            assert isinstance(d, Reject), d
            assert after.bucket == pytest.approx(before.bucket)
            assert store.preemptible_leases("p", now) == groups
        assert after.concurrency >= 0 and after.leases >= 0
        assert covered(after) == pytest.approx(covered(before))  # owners spend their share
    return taken, drew


def test_lent_work_gives_its_tokens_back_to_the_owners_on_generated_pools() -> None:
    runs = [check_pool(seed, MemoryStore()) for seed in range(80)]
    # the rule, not the fallbacks, was tested
    assert sum(1 for taken, _ in runs if taken) >= 40, runs
    assert sum(1 for _, drew in runs if drew) >= 40, runs


def test_lent_work_gives_its_tokens_back_on_redis(redis_url: str) -> None:
    from tokenpools.state.redis.store import RedisStore

    runs = [
        check_pool(seed, RedisStore(redis_url, prefix=secrets.token_hex(4), timeout_s=2.0))
        for seed in range(12)
    ]
    assert sum(1 for taken, _ in runs if taken) >= 4, runs
    assert sum(1 for _, drew in runs if drew) >= 4, runs


def test_where_taking_back_ends_work_lent_work_leaves_the_protected_share_alone() -> None:
    """A host that cannot suspend: preemptible work stops at the protected share of the
    bucket (less the overcommit), and an owner finds its share there."""
    setup = {"tokens_per_s": 800, "policy": {"burstWindowS": 10, "overcommit": 0.0}}
    ents = [
        {"name": "owner", "serviceClass": "guaranteed", "sloTargetMs": 1000, "concurrency": 16},
        {"name": "lent", "serviceClass": "preemptible"},
    ]
    config = make_config(
        ents, concurrency=SLOTS, kv_tokens=SLOTS * KV_PER_SLOT, tokens_per_s=800,
        policy=setup["policy"],
    )  # fmt: skip
    store = MemoryStore()
    core = DecisionCore(config, store, now=0.0, suspends=False)
    now = core.policy.update_period_s + 0.1
    core.tick(now)
    for i in range(100):
        core.admit("lent", RequestCost(100, 100), now, f"lent-{i}")
    counters = store.pool_counters("p", now)
    share = 800 * 16 / SLOTS * 10  # the owner's baseline over the burst window: 2,000 tokens
    assert counters.protected_bucket == pytest.approx(share)
    assert share <= counters.bucket < share + 200  # lent work stopped at the share
    for j in range(10):  # the owner's whole share, 200 tokens at a time, nothing evicted
        d = core.admit("owner", RequestCost(100, 100), now, f"owner-{j}")
        assert isinstance(d, Admit) and not d.evict and not d.overcommit, d


def test_retry_after_for_unreserved_tokens_counts_what_lent_work_gives_back() -> None:
    """The refusal's wait is the refill of what the check found missing: bucket 100 and 600
    that lent work would give back, against a protected share of 1,000 less a 200-token
    overcommit, leave 150 tokens 250 short: 5 s at 50 tokens/s (13 s counting the bucket
    alone)."""
    values: dict[str, Any] = {f.name: INF for f in fields(ReservePlan)}
    values.update(own_required=False, surplus=False, nonpreemptible_bucket_floor=-200.0)
    plan = ReservePlan(**values)
    pool = PoolCounters(0, 0, 0, 0, 0, 0, bucket=100.0, protected_bucket=1000.0, leases=0,
                        reclaimable_tokens=600.0)  # fmt: skip
    ent = EntitlementCounters(0, 0, 0.0, 0)
    wait = expected_wait_s(
        Shortfall.RESERVED_THROUGHPUT, 150.0, 10.0, plan, pool, ent,
        BucketSpec(50.0, 5000.0), BucketSpec(INF, INF), 1.0, 5.0,
    )  # fmt: skip
    assert wait == pytest.approx(5.0)


def two_slots(ents: list[dict[str, Any]], store: Store) -> DecisionCore:
    """A pool of two slots and a 4,000-token bucket (400 tokens/s over 10 s), no overcommit,
    on a host that suspends."""
    config = make_config(
        ents, concurrency=2, kv_tokens=2 * KV_PER_SLOT, tokens_per_s=400,
        policy={"burstWindowS": 10, "overcommit": 0.0},
    )  # fmt: skip
    return DecisionCore(config, store, now=0.0, suspends=True)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_what_is_given_back_never_fills_the_bucket_past_its_depth(
    store: str, request: pytest.FixtureRequest
) -> None:
    """An owner takes a slot back from lent work while the bucket is full again: the lease's
    reservation goes back, but the bucket holds at most its depth."""
    ents = [
        {"name": "owner", "serviceClass": "guaranteed", "sloTargetMs": 1000, "concurrency": 1},
        {"name": "lent", "serviceClass": "preemptible"},
    ]
    backend = store_named(store, request)
    core = two_slots(ents, backend)
    now = core.policy.update_period_s + 0.1
    core.tick(now)
    lent = [core.admit("lent", RequestCost(100, 200), now, f"lent-{i}") for i in range(2)]
    assert all(isinstance(d, Admit) for d in lent)
    now += 10.0  # the bucket refills to its depth, 4,000
    assert backend.pool_counters("p", now).bucket == pytest.approx(4000.0)
    d = core.admit("owner", RequestCost(50, 50), now, "owner-0")
    assert isinstance(d, Admit) and [v.lease_id for v in d.evict] == ["lent-1"]
    assert backend.pool_counters("p", now).bucket == pytest.approx(4000.0 - 100)


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("resumable", [True, False])
def test_work_taken_back_at_a_capacity_loss_gives_its_tokens_back_as_at_admission(
    store: str, resumable: bool, request: pytest.FixtureRequest
) -> None:
    """A replica loses half its slots under two lent requests: the one taken back gives its
    reservation back to the bucket where its host suspends it (its continuation reserves
    again), and nothing where taking it back ends it."""
    ents = [{"name": "lent", "serviceClass": "preemptible"}]
    backend = store_named(store, request)
    core = two_slots(ents, backend)
    cost = RequestCost(100, 200, resumable=resumable)
    assert all(isinstance(core.admit("lent", cost, 1.0, f"lent-{i}"), Admit) for i in range(2))
    before = backend.pool_counters("p", 1.0).bucket  # 4,000 less two reservations of 300
    one_slot = Resources(400, KV_PER_SLOT, 1)  # the same throughput
    change = core.set_capacity("p", 1.0, per_replica=one_slot)
    assert [lease.lease_id for lease in change.evict] == ["lent-1"]
    after = backend.pool_counters("p", 1.0)
    assert before == pytest.approx(3400.0)
    assert after.bucket == pytest.approx(before + (300.0 if resumable else 0.0))
    assert after.reclaimable_tokens == pytest.approx(300.0 if resumable else 0.0)
