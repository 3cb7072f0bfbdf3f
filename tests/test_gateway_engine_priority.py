"""The gateway in front of an emulated vLLM that schedules by priority: each admitted request
reaches the engine with its class's priority, whatever the client put in its body; in front of
a first-come-first-served engine, a client's priority never reaches it (vLLM would refuse a
non-zero one)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from tests.gateway_setup import FAST, MODEL, client, config_data, wait_all_ended
from tests.servers import ServerThread
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.objectives import engine_priority
from tokenpools.model.service_class import ServiceClass

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _recording(seen: list[dict[str, Any]]) -> Any:
    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST":  # the gateway's health checks are GETs
            seen.append(json.loads(await request.read()))
        return await handler(request)

    return record


@pytest.fixture(params=["fcfs", "priority"])
def stack(request: pytest.FixtureRequest) -> Iterator[tuple[str, ServerThread, list[Any]]]:
    scheduling = request.param
    seen: list[dict[str, Any]] = []
    app = make_emulator(FAST, 1.0, scheduling)
    app.middlewares.append(_recording(seen))
    engine = ServerThread(app)
    data = config_data(engine.url)
    data["pools"][0]["schedulingPolicy"] = scheduling
    gateway = ServerThread(make_app(Gateway(parse_config(data)), health_interval_s=0.2))
    try:
        yield scheduling, gateway, seen
        wait_all_ended(gateway)
    finally:
        gateway.stop()
        engine.stop()


@pytest.mark.parametrize(
    ("who", "service_class"), [("gold", ServiceClass.GUARANTEED), ("spot", ServiceClass.SPOT)]
)
@pytest.mark.parametrize("sent", [None, -1000, 7])
def test_the_engine_sees_the_class_priority_never_the_clients(
    stack: tuple[str, ServerThread, list[Any]],
    who: str,
    service_class: ServiceClass,
    sent: int | None,
) -> None:
    scheduling, gateway, seen = stack
    extra = {} if sent is None else {"extra_body": {"priority": sent}}
    reply = client(gateway, who).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, **extra
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    (body,) = seen
    if scheduling == "priority":
        assert body["priority"] == engine_priority(service_class)
    else:
        assert "priority" not in body
