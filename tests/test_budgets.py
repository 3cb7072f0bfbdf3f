"""Budgets: windows aligned in the configured time zone (generated instants and zones), and a
budget never overspent over generated runs of admissions and every kind of lease end, on the
memory store and on Redis (the same events decide the same), with Retry-After pointing at the
window's reset and max_tokens lowered where a budget allows it."""

from __future__ import annotations

import random
import zoneinfo
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenpools.control.budgets import budget_status, window
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Reason, Reject
from tokenpools.model.budgets import Period
from tokenpools.model.config import ConfigError, parse_config
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.state.memory import MemoryStore

ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Asia/Kolkata", "Australia/Lord_Howe"]


@settings(max_examples=300, deadline=None)
@given(
    now=st.floats(min_value=1.6e9, max_value=2.2e9),
    zone=st.sampled_from(ZONES),
    period=st.sampled_from([Period.HOUR, Period.DAY, Period.WEEK, Period.MONTH]),
)
def test_a_window_holds_its_instant_and_starts_where_the_zone_says(
    now: float, zone: str, period: Period
) -> None:
    tz = zoneinfo.ZoneInfo(zone)
    start, end = window(period, tz, now)
    assert start <= now < end
    local = datetime.fromtimestamp(start, tz)
    if period != Period.HOUR:
        # local midnight (or the first instant of the day, where a DST change skips midnight)
        assert datetime.fromtimestamp(start - 1, tz).date() == local.date() - timedelta(days=1)
    if period == Period.WEEK:
        assert local.weekday() == 0
    if period == Period.MONTH:
        assert local.day == 1
    assert window(period, tz, end)[0] == end  # the next window starts where this one ends
    assert window(period, tz, end - 1e-3)[1] == end


def config(**budget: Any) -> dict[str, Any]:
    return {
        "policy": {"retryAfterMinS": 1},
        "usage": {"timeZone": "Europe/Berlin"},
        "pools": [
            {"name": "p", "model": "Qwen3-8B", "tokenWeights": {"input": 1, "output": 2},
             "prices": {"inputPerMillion": "0.15", "outputPerMillion": "0.60",
                        "cachedInputPerMillion": "0.075"},
             "perReplica": {"tokensPerSecond": 1e9, "kvTokens": 10**7, "concurrency": 64}},
        ],
        "entitlements": [
            {"name": "a", "tenantId": "acme", "pool": "p", "serviceClass": "elastic",
             "concurrency": 64},
            {"name": "b", "tenantId": "bolt", "pool": "p", "serviceClass": "elastic"},
        ],
        "budgets": [{"name": "acme-month", "tenant": "acme", "limit": 5000, **budget}],
    }  # fmt: skip


ACME = Account("acme", "laptop", "m")


def test_the_config_names_what_is_wrong_with_a_budget() -> None:
    bad = config()
    bad["budgets"] = [
        {"name": "y", "tenant": "acme", "entitlement": "a", "limit": 5},
        {"name": "z", "entitlement": "a", "measure": "cost", "limit": "0.0000001"},
        {"name": "v", "tenant": "acme", "limit": -3},
    ]
    with pytest.raises(ConfigError) as exc:
        parse_config(bad)
    text = str(exc.value)
    assert "budgets[0]: budget 'y': give exactly one of tenant, entitlement or key" in text
    assert "budgets[1]: '0.0000001' has more than 6 decimal places" in text
    assert "budgets[2]: budget 'v': a token limit is a whole number >= 0" in text
    bad["budgets"] = [
        {"name": "x", "tenant": "nobody", "limit": 5},
        {"name": "w", "key": "acme/none", "limit": 5},
        {"name": "x", "entitlement": "a", "limit": 5},
    ]
    with pytest.raises(ConfigError) as exc:
        parse_config(bad)
    text = str(exc.value)
    assert "budgets[0].tenant: unknown tenant 'nobody'" in text
    assert "budgets[1].key: no key labelled 'acme/none'" in text
    assert "budgets[2].name: duplicate name 'x'" in text
    with pytest.raises(ConfigError, match="unknown time zone"):
        parse_config({**config(), "usage": {"timeZone": "Mars/Olympus"}})


def test_refused_at_the_limit_with_retry_after_until_the_zones_midnight() -> None:
    cfg = parse_config(config(window="day"))
    # 22:30 UTC on 2026-12-01 is 23:30 in Berlin: the day resets in 30 minutes
    now = datetime(2026, 12, 1, 22, 30, tzinfo=zoneinfo.ZoneInfo("UTC")).timestamp()
    core = DecisionCore(cfg, MemoryStore(counters_on_admit=True), now=now)
    first = core.admit("a", RequestCost(1000, 1500, 1, ACME), now)  # worst: 1000 + 2 × 1500
    assert isinstance(first, Admit) and first.budget == ("acme-month", 1000.0, now + 1800)
    second = core.admit("a", RequestCost(500, 500, 1, ACME), now)
    assert isinstance(second, Reject) and second.reason == Reason.INSUFFICIENT_QUOTA
    assert second.budget == "acme-month" and "1000 tokens left" in second.message
    assert second.retry_after_s == pytest.approx(1800)
    assert isinstance(core.admit("b", RequestCost(500, 500), now), Admit)  # others unaffected
    core.settle(first.lease.lease_id, Usage(1000, 100), now + 1)  # charged 1200, 3800 back
    assert isinstance(core.admit("a", RequestCost(500, 500, 1, ACME), now + 2), Admit)
    # the next day in Berlin: a fresh window
    later = core.admit("a", RequestCost(1000, 1990, 1, ACME), now + 1800)
    assert isinstance(later, Admit)


def test_max_tokens_lowered_to_what_the_budget_has_left_when_it_allows() -> None:
    cfg = parse_config(config(lowerMaxTokens=True))
    core = DecisionCore(cfg, MemoryStore(counters_on_admit=True), now=0.0)
    step = core.admit("a", RequestCost(1000, 1000, 1, ACME), 0.0)  # 3000 of 5000
    assert isinstance(step, Admit)
    # needs 5000, 2000 left: refused as asked, then admitted once more with max_tokens lowered
    # to what is left: 1,000 prompt tokens + 2 sequences × weight 2 × 250 = 2,000
    lowered = core.admit("a", RequestCost(1000, 1000, 2, ACME), 0.0)
    assert isinstance(lowered, Admit) and lowered.lowered and lowered.max_tokens == 250
    assert budget_status(core, 0.0)[0]["left"] == 0


def test_money_is_priced_exactly_in_micro_units() -> None:
    cfg = parse_config(config(measure="cost", limit="0.002"))  # 2,000 micro-units
    core = DecisionCore(cfg, MemoryStore(counters_on_admit=True), now=0.0)
    # 1,000 in × 0.15 + 2,000 out × 0.60 per million = 150 + 1,200 micro-units
    d = core.admit("a", RequestCost(1000, 2000, 1, ACME), 0.0)
    assert isinstance(d, Admit) and d.budget is not None and d.budget[1] == 650
    core.settle(d.lease.lease_id, Usage(1000, 10, cached_tokens=600), 1.0)
    # 400 × 0.15 + 600 × 0.075 + 10 × 0.60 = 60 + 45 + 6 = 111
    assert budget_status(core, 1.0)[0]["used"] == 111


def run_random(core: DecisionCore, seed: int, steps: int = 400) -> list[Any]:
    """Admissions of random sizes and every kind of end: settled (on a random usage: the engine
    may count fewer or more prompt tokens than estimated), released with or without refund,
    expired. After each step: used + held never above the limit."""
    rng = random.Random(seed)
    held: list[Admit] = []
    seen: list[Any] = []
    now = 1_800_000_000.0
    for _ in range(steps):
        now += rng.choice([0.01, 0.5, 5.0])
        roll = rng.random()
        if roll < 0.55 or not held:
            cost = RequestCost(rng.randint(1, 400), rng.randint(0, 600), rng.randint(1, 3), ACME)
            d = core.admit("a", cost, now)
            seen.append((type(d).__name__, getattr(d, "reason", None)))
            if isinstance(d, Admit):
                held.append(d)
        else:
            d = held.pop(rng.randrange(len(held)))
            kind = rng.random()
            worst = d.lease.meter.worst if d.lease.meter else None
            assert worst is not None
            if kind < 0.6:
                core.settle(
                    d.lease.lease_id,
                    Usage(
                        int(worst.input * rng.choice([1.0, 1.0, 0.5, 1.7, 3.0])),
                        rng.randint(0, int(worst.output)),
                    ),
                    now,
                )
            elif kind < 0.8:
                core.release(d.lease.lease_id, now, refund=rng.random() < 0.5)
            else:
                core.tick(now + core.policy.lease_ttl_s + 1)  # this one (and any other) expires
                held = [h for h in held if core.store.get_lease(h.lease.lease_id, now) is not None]
        for b in budget_status(core, now):
            assert b["used"] + b["held"] <= b["limit"], b
            assert b["held"] >= 0
            seen.append((b["used"], b["held"]))
    return seen


@pytest.mark.parametrize("seed", range(8))
def test_a_budget_is_never_overspent_over_generated_runs(seed: int) -> None:
    rng = random.Random(seed)
    limit = rng.choice([800, 5000, 20000])
    measure = rng.choice(["tokens", "input", "output", "cost"])
    cfg = parse_config(config(limit=limit if measure != "cost" else "0.004", measure=measure))
    core = DecisionCore(cfg, MemoryStore(counters_on_admit=True), now=1_800_000_000.0)
    seen = run_random(core, seed)
    assert ("Reject", Reason.INSUFFICIENT_QUOTA) in seen  # the budget was reached
    assert any(s[0] == "Admit" for s in seen)


@pytest.mark.parametrize("seed", range(3))
def test_redis_decides_budgets_as_the_memory_store_does(
    redis_url: str, redis_client: Any, seed: int
) -> None:
    from tokenpools.state.redis.store import RedisStore

    cfg = parse_config(config(limit=3000))
    now = 1_800_000_000.0
    local = MemoryStore(counters_on_admit=True)
    memory = run_random(DecisionCore(cfg, local, now=now), seed)
    store = RedisStore(redis_url, prefix=f"t{seed}", timeout_s=2.0)
    shared = run_random(DecisionCore(cfg, store, now=now), seed)
    assert shared == memory
    # and the usage ledger counted the same: requests, tokens, cost, refusals by reason
    later = now + 10_000

    def ledger(rows: Any) -> dict[tuple[int, str], dict[str, float]]:
        return {(r.hour, r.bucket): dict(r.values) for r in rows}

    expected = ledger(local.pending_usage("p", later, 10**6).rows)
    assert expected and any("refused:budget" in v for v in expected.values())
    assert ledger(store.pending_usage("p", later, 10**6).rows) == expected


def test_on_redis_an_admission_and_a_settlement_are_one_call_each_with_budgets(
    redis_url: str, redis_client: Any
) -> None:
    """Budgets and the ledger ride in the same script call: one EVALSHA per admission and one
    per settlement (INFO commandstats, which also counts the commands the script runs), and
    no other command from the client (counted where redis-py sends them)."""
    from tokenpools.state.redis.store import RedisStore

    data = config(limit=10**9)
    data["budgets"] += [
        {"name": "a-day", "entitlement": "a", "limit": 10**9, "window": "day"},
        {"name": "key-hour", "key": "acme/a", "measure": "cost", "limit": "1000", "window": "hour"},
    ]
    data["entitlements"][0]["apiKeys"] = ["sha256:" + "0" * 64]
    cfg = parse_config(data)
    store = RedisStore(redis_url, prefix="calls", timeout_s=2.0)
    core = DecisionCore(cfg, store, now=0.0)
    account = Account("acme", "a", "m")
    now = 1_800_000_000.0
    warm = core.admit("a", RequestCost(10, 10, 1, account), now)  # loads the script
    assert isinstance(warm, Admit) and len(warm.lease.meter.holds) == 3  # type: ignore[union-attr]
    core.settle(warm.lease.lease_id, Usage(10, 5), now)

    def calls() -> dict[str, int]:
        stats = redis_client.info("commandstats")
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}

    sent: list[str] = []
    send = store.client.execute_command

    def counted(*args: Any, **kw: Any) -> Any:
        sent.append(str(args[0]))
        return send(*args, **kw)

    store.client.execute_command = counted  # type: ignore[method-assign]
    before = calls()
    for i in range(50):
        d = core.admit("a", RequestCost(10, 10, 1, account), now + i)
        assert isinstance(d, Admit)
        core.settle(d.lease.lease_id, Usage(10, 5), now + i)
    after = calls()
    assert after["evalsha"] - before["evalsha"] == 100
    assert sent == ["EVALSHA"] * 100


def test_a_budget_over_several_pools_is_refused_on_a_redis_cluster_only() -> None:
    from tokenpools.admission.driver import check_cluster_budgets

    data = config()
    data["pools"].append({**data["pools"][0], "name": "q"})
    data["entitlements"].append({"name": "a2", "tenantId": "acme", "pool": "q",
                                 "serviceClass": "elastic"})  # fmt: skip
    data["budgets"].append({"name": "a-only", "entitlement": "a", "limit": 5})
    data["state"] = {"backend": "redis", "url": "redis+cluster://127.0.0.1:7000"}
    with pytest.raises(ConfigError, match="budgets acme-month: their requests go to several"):
        check_cluster_budgets(parse_config(data))
    data["budgets"] = data["budgets"][1:]  # one pool's budget: its counter shares the slot
    check_cluster_budgets(parse_config(data))
    data["budgets"] = config()["budgets"]
    data["state"] = {"backend": "redis", "url": "redis://127.0.0.1:6379/0"}
    check_cluster_budgets(parse_config(data))  # one Redis keeps any key


@pytest.mark.parametrize("seed", range(2))
def test_layered_requests_meet_their_budgets_alike_on_redis_and_in_memory(
    redis_url: str, redis_client: Any, seed: int
) -> None:
    """A tenant's layers (guaranteed, then spot) under one tenant budget: each layer is
    tried as one admission is, the budget refuses all of them alike, and the ledger counts a
    refused request once, on its first layer."""
    from tokenpools.state.redis.store import RedisStore

    data = config(limit=4000)
    data["entitlements"][0]["concurrency"] = 2
    data["entitlements"][0]["serviceClass"] = "guaranteed"
    data["entitlements"].append({"name": "a-spot", "tenantId": "acme", "pool": "p",
                                 "serviceClass": "spot"})  # fmt: skip
    cfg = parse_config(data)

    def run(core: DecisionCore) -> list[Any]:
        rng = random.Random(seed)
        held: list[Admit] = []
        seen: list[Any] = []
        now = 1_800_000_000.0
        for _ in range(200):
            now += 0.5
            if held and rng.random() < 0.4:
                d = held.pop(0)
                core.settle(d.lease.lease_id, Usage(50, rng.randint(0, 100)), now)
                continue
            cost = RequestCost(50, rng.randint(10, 200), 1, ACME)
            d = core.admit(["a", "a-spot"], cost, now)
            seen.append(d.lease.entitlement if isinstance(d, Admit) else d.reason)
            if isinstance(d, Admit):
                held.append(d)
        seen.append(
            {
                (r.hour, r.bucket): dict(r.values)
                for r in core.store.pending_usage("p", now, 10**6).rows
            }
        )
        return seen

    memory = run(DecisionCore(cfg, MemoryStore(counters_on_admit=True), now=0.0))
    shared = run(
        DecisionCore(cfg, RedisStore(redis_url, prefix=f"l{seed}", timeout_s=2.0), now=0.0)
    )
    assert shared == memory
    assert {"a", "a-spot", Reason.INSUFFICIENT_QUOTA} <= set(memory[:-1])
