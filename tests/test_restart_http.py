"""A gateway replica restarted on a shared store, over HTTP (docs/decisions.md, "A restart"):
the new process keeps the claims the store measured (the admin API shows what surplus work
must leave free), where a restart on an empty store claims every baseline again. Real Redis,
real gateways; the clock is injected and the update periods are ticked by hand."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.gateway_setup import admin, config_data, emulator  # noqa: F401  (a fixture)
from tests.servers import ServerThread
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def claimed(server: ServerThread) -> float:
    return float(admin(server, "pools")["pool"]["claimed"]["concurrency"])


@pytest.fixture
def redis_config(emulator: ServerThread, redis_url: str) -> Iterator[dict[str, Any]]:  # noqa: F811
    redis.Redis.from_url(redis_url).flushall()
    data = config_data(emulator.url, backfillWindowS=40, updatePeriodS=5)
    data["state"] = {"backend": "redis", "url": redis_url}
    yield data
    redis.Redis.from_url(redis_url).flushall()


def start(data: dict[str, Any], clock: Clock) -> tuple[ServerThread, Gateway]:
    gw = Gateway(parse_config(data), clock=clock)
    # ticks far apart in real time: this test runs the update periods itself
    return ServerThread(make_app(gw, tick_interval_s=3600)), gw


def test_a_replica_restarted_on_redis_keeps_what_the_store_measured(
    redis_config: dict[str, Any], redis_url: str
) -> None:
    clock = Clock()
    first, gw = start(redis_config, clock)
    assert claimed(first) == 4  # gold's baseline, until measured
    for _ in range(40):  # 200 s of update periods with gold idle: its claim fades away
        clock.now += 5
        first.call(gw.tick)
    assert claimed(first) < 0.1
    first.stop()

    second, gw = start(redis_config, clock)  # a rolling update: the same Redis
    try:
        assert claimed(second) < 0.1
    finally:
        second.stop()

    redis.Redis.from_url(redis_url).flushall()  # a Redis restarted without persistence
    third, gw = start(redis_config, clock)
    try:
        assert claimed(third) == 4
    finally:
        third.stop()
