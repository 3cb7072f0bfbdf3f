"""Shared builders: configs are written as the YAML a user would write, then parsed."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from tokenpools.control.store import Store
from tokenpools.model.config import Config, parse_config
from tokenpools.state.memory import MemoryStore

# The simulator's one pool of one engine (the paper's DGX Spark profile), as scenarios name it.
SIM_POOL: dict[str, Any] = {
    "name": "p",
    "model": "Qwen3-8B",
    "perReplica": {"tokensPerSecond": 480, "kvTokens": 65536, "concurrency": 16},
}


def make_config(
    entitlements: list[dict[str, Any]],
    *,
    concurrency: float = 16,
    tokens_per_s: float = 480,
    kv_tokens: float = 32768,
    replicas: int = 1,
    policy: dict[str, Any] | None = None,
    pool_extra: dict[str, Any] | None = None,
) -> Config:
    pool = {
        "name": "p",
        "model": "Qwen3-8B",
        "replicas": replicas,
        "maxReplicas": max(replicas, 8),
        "perReplica": {
            "tokensPerSecond": tokens_per_s,
            "kvTokens": kv_tokens,
            "concurrency": concurrency,
        },
        **(pool_extra or {}),
    }
    ents = [{"tenantId": e["name"], "pool": "p", **e} for e in entitlements]
    return parse_config({"policy": policy or {}, "pools": [pool], "entitlements": ents})


def store_named(name: str, request: pytest.FixtureRequest) -> Store:
    """The store a test is parametrised over: "memory", or "redis" (the `redis_url` fixture's
    server) under a fresh key prefix."""
    if name == "memory":
        return MemoryStore()
    from tokenpools.state.redis.store import RedisStore

    url = request.getfixturevalue("redis_url")
    return RedisStore(url, prefix=secrets.token_hex(4), timeout_s=2.0)
