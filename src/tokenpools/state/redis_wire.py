"""The wire between RedisStore and its Lua script: the script (state/lua/, parts joined in
order), and how arguments and replies are written — numbers as 17-significant-digit strings,
so a float survives the round trip exactly; lease rows; counter replies; reserve plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from importlib.resources import files
from typing import Any

from tokenpools.state.base import EntitlementCounters, Lease, PoolCounters, ReservePlan

LUA_PARTS = ("storage.lua", "leases.lua", "reserve.lua", "operations.lua")
SCRIPT = "\n".join(files("tokenpools.state").joinpath("lua", p).read_text() for p in LUA_PARTS)
_PLAN_FIELDS = [f.name for f in fields(ReservePlan)]


def num(x: float | bool) -> str:
    return repr(float(x))


def lease(row: Sequence[Any], pool: str) -> Lease:
    # id, entitlement, tokens, kv, started, expires, preemptible, reserved, drew_own
    text = [v.decode() if isinstance(v, bytes) else v for v in row]
    return Lease(
        lease_id=text[0],
        pool=pool,
        entitlement=text[1],
        tokens=float(text[2]),
        kv_tokens=float(text[3]),
        started_at=float(text[4]),
        expires_at=float(text[5]),
        preemptible=text[6] == "1",
        reserved_path=text[7] == "1",
        drew_own=text[8] == "1",
    )


def pool_counters(reply: Sequence[bytes]) -> PoolCounters:
    c = [float(x) for x in reply]
    return PoolCounters(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], int(c[8]))


def entitlement_counters(reply: Sequence[bytes]) -> EntitlementCounters:
    c = [float(x) for x in reply]
    return EntitlementCounters(c[0], c[1], c[2], int(c[3]))


_plan_cache: dict[ReservePlan, list[str]] = {}


def plan_args(plan: ReservePlan) -> list[str]:
    args = _plan_cache.get(plan)
    if args is None:
        if len(_plan_cache) > 4096:
            _plan_cache.clear()
        args = _plan_cache[plan] = [num(getattr(plan, name)) for name in _PLAN_FIELDS]
    return args


def lease_args(lease: Lease) -> list[str]:
    """A new lease as the script takes it: id, entitlement, tokens, kv, started, expires, pre."""
    return [
        lease.lease_id,
        lease.entitlement,
        num(lease.tokens),
        num(lease.kv_tokens),
        num(lease.started_at),
        num(lease.expires_at),
        "1" if lease.preemptible else "0",
    ]
