"""The one wire contract between RedisStore and its Lua script: every name the script reads is
declared in state/redis/wire.py, every declared name is used, and a whole admission, refusal
included, is one round trip."""

from __future__ import annotations

import re
from dataclasses import fields
from importlib.resources import files

import pytest

from tests.builders import make_config
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Reject
from tokenpools.control.store import EntitlementCounters, PoolCounters, ReservePlan
from tokenpools.model.request import RequestCost
from tokenpools.state.memory import MemoryStore
from tokenpools.state.redis import wire
from tokenpools.state.redis.store import RedisStore

LUA = {p: files("tokenpools.state.redis").joinpath("lua", p).read_text() for p in wire.LUA_PARTS}
SOURCE = "\n".join(LUA.values())


def _lua_list(name: str) -> list[str]:
    """The string items of `local NAME = { ... }` in the script's parts."""
    body = re.search(rf"local {name} = \{{([^}}]*)\}}", SOURCE, re.S)
    assert body is not None, name
    return re.findall(r"'([a-z_]+)'", body.group(1))


def test_every_argument_the_script_reads_is_declared_and_every_declared_one_is_read() -> None:
    used = set(re.findall(r"\bA\.([a-z_]+)", SOURCE))  # A: argument name -> ARGV index
    declared = {name for names in wire.OPS.values() for name in names}
    assert used == declared
    assert set(re.findall(r"\bH\.([a-z_]+)", SOURCE)) == {"owner"}  # the header's, by name
    beyond_header = rf"ARGV\[[{len(wire.HEADER) + 1}-9]\]|ARGV\[\d\d\]"
    assert not re.search(beyond_header, SOURCE)  # nothing read by position


def test_every_plan_number_the_script_reads_is_a_plan_field() -> None:
    used = set(re.findall(r"\bplan\.([a-z_]+)", SOURCE))
    assert used == {f.name for f in fields(ReservePlan)}
    assert tuple(f.name for f in fields(ReservePlan)) == wire.PLAN_FIELDS


def test_counters_and_lease_rows_map_every_field_to_a_stored_one() -> None:
    assert list(wire.POOL_COUNTERS) == [f.name for f in fields(PoolCounters)]
    assert list(wire.ENTITLEMENT_COUNTERS) == [f.name for f in fields(EntitlementCounters)]
    assert set(wire.POOL_COUNTERS.values()) <= set(_lua_list("POOL_FIELDS"))
    assert set(wire.ENTITLEMENT_COUNTERS.values()) <= set(_lua_list("ENT_FIELDS"))
    # every stored field travels back in a lease row, but its owner (Redis's own bookkeeping)
    # and its meter (the budgets and ledger bucket its lease ends charge, in METER_ARGS order)
    meter = ["bucket", "w_in", "w_out", "w_cost", "holds"]
    assert meter == list(wire.METER_ARGS)
    assert [*wire.LEASE_ROW.values(), "owner", *meter] == _lua_list("LEASE_FIELDS")


def test_the_generated_prelude_is_what_the_script_starts_with() -> None:
    assert wire.SCRIPT.startswith(wire.prelude())
    assert "local A = {}" in wire.prelude() and "local PLAN_AT" in wire.prelude()


def test_arguments_are_checked_by_name() -> None:
    with pytest.raises(TypeError, match="renew takes"):
        wire.args("renew", id="x")


def _evalsha_calls(client) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_an_admission_and_a_refusal_each_cost_one_round_trip(redis_url: str, redis_client) -> None:
    cfg = make_config([{"name": "gold", "serviceClass": "guaranteed", "concurrency": 1}])
    core = DecisionCore(cfg, RedisStore(redis_url, timeout_s=1.0), fallback_store=MemoryStore())
    small = RequestCost(10, 10)
    core.admit("gold", small, 1.0)  # the first call also configures the pool
    before = _evalsha_calls(redis_client)
    second = core.admit("gold", small, 1.0)
    after_refusal = _evalsha_calls(redis_client)
    assert isinstance(second, Reject) and second.quota is not None
    assert second.quota.remaining_requests == 0
    assert after_refusal - before == 1


def test_a_budget_measure_names_a_charge_field_and_the_script_knows_every_one() -> None:
    """One declaration: a budget's measure is a Charge field's name, in Python and in Lua."""
    from tokenpools.control.metering import Charge
    from tokenpools.model.budgets import Measure

    charge = [f.name for f in fields(Charge)]
    assert {m.value for m in Measure} <= set(charge)
    script = wire.SCRIPT
    worst = script.split("local function worst(l)", 1)[1].split("end", 1)[0]
    assert [
        part.split("=")[0].strip() for part in worst.split("{")[1].split("}")[0].split(",")
    ] == charge
