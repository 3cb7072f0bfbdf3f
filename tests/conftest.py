"""Fixtures for tests that need a real Redis server (one per test session, on a free loopback
port, started and stopped here; `.ci/run` installs redis-server), and the gateway's (an
emulator, and a gateway in front of it: tests/gateway_setup.py)."""

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
