"""What tests read of the ledger in Redis with their own client (so they see it while the
gateway's loop is stalled): a pool's and its entitlements' in-flight, KV and lease counters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# An entitlement's counters live packed in its record (state/redis/lua/storage.lua): read
# them there.
RECORD_COUNTERS = """local raw = redis.call('HGET', KEYS[1], 's')
if not raw then return {} end
local t = cmsgpack.unpack(raw)
return { tostring(t.conc), tostring(t.kv), tostring(t.leases) }"""
COUNTERS = ("conc", "kv", "leases")


def redis_counters(
    client: Any, entitlements: Iterable[str], pool: str = "p", prefix: str = "tokenpools"
) -> dict[str, dict[str, float]]:
    """By key (the pool, then each entitlement): its counters; a key not there is left out.
    `client` is any redis-py client that routes by key (a cluster client too)."""
    key = f"{prefix}:{{{pool}}}"
    out: dict[str, dict[str, float]] = {}
    values = client.hmget(key, *COUNTERS)
    if values[0] is not None:
        out[key] = {n: float(v) for n, v in zip(COUNTERS, values, strict=True)}
    for name in entitlements:
        ekey = f"{key}:e:{name}"
        values = client.eval(RECORD_COUNTERS, 1, ekey)
        if values:
            out[ekey] = {n: float(v) for n, v in zip(COUNTERS, values, strict=True)}
    return out


def negative(counters: dict[str, dict[str, float]]) -> list[str]:
    return [
        f"{key} {name}={value}"
        for key, values in counters.items()
        for name, value in values.items()
        if value < -1e-9
    ]


def nonzero(counters: dict[str, dict[str, float]]) -> list[str]:
    return [
        f"{key} {name}={value}"
        for key, values in counters.items()
        for name, value in values.items()
        if abs(value) > 1e-9
    ]
