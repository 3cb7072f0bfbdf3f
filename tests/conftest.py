"""Fixtures for tests that need a real Redis server (one per test session, on a free loopback
port, started and stopped here; `.ci/run` installs redis-server), and the gateway's (an
emulator, and a gateway in front of it: tests/gateway_setup.py); and which tests run on one
build only (ONE_BUILD)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import redis

from tests.gateway_setup import emulator, gateway
from tokenpools.processes import redis_server

__all__ = ["emulator", "gateway", "redis_client", "redis_url"]

# Gateways keep their usage ledger in the user's state directory by default: one of the
# session's own, so tests never write into the home directory.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="tokenpools-state-")


# `make test` runs every test on the compiled build (what `pip install .` gives), and every test
# but these on the plain-Python one too. The two builds differ only in the modules setup.py
# compiles (the decision core, the memory store); these modules test what the builds share:
# code that is not compiled, or the core driven through other processes and tools, whose
# decisions the rest of the suite checks in-process on both builds. Marked `one_build`.
ONE_BUILD = {
    "test_benchmarks_smoke.py": "the benchmark scripts (`make bench` runs them on .venv)",
    "test_demo.py": "`make demo`, on .venv",
    "test_packaging.py": "a `pip install .` into a venv of its own, whatever runs the test",
    "test_real_engine.py": "a real llama.cpp server",
    "test_litellm.py": "a LiteLLM proxy, in .venv-litellm whatever runs the test",
    "test_dashboard_browser.py": "the dashboard's page, in Chromium",
    "test_ledger_faults.py": "the usage ledger (SQLite, PostgreSQL), which is not compiled",
    "test_usage_ledger.py": "the usage ledger, which is not compiled",
    "test_replicas.py": "gateway replicas on a Redis store (its Lua, not compiled)",
    "test_budget_replicas.py": "budgets across gateway replicas on Redis",
    "test_suspension_killed.py": "a gateway killed on Redis (processes, the Lua not compiled)",
    "test_redis_cluster.py": "the Redis store on a Redis Cluster",
    "test_redis_sentinel.py": "the Redis store behind Sentinel",
    "test_extproc.py": "the Envoy host (gRPC), through a real Envoy",
    "test_extproc_faults.py": "the Envoy host's faults",
    "test_authz.py": "the ext_authz host, through a real Envoy",
    "test_k8s_*": "the operator, the webhook and `serve --kubernetes`, which are not compiled",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.path.match(pattern) for pattern in ONE_BUILD):
            item.add_marker(pytest.mark.one_build)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_server() as (url, _):
        yield url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()
