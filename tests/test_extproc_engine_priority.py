"""Through a real Envoy with the ext_proc processor: on a pool whose engines schedule by
priority, each admitted request reaches the engine with its class's priority in the body, in
both of the processor's request body modes; a client's own never does."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from aiohttp import web

from tests.envoy_setup import LoopThread, Picker, start_envoy, start_grpc
from tests.gateway_setup import FAST, KEYS, MODEL, config_data
from tests.servers import ServerThread, wait_for
from tests.test_gateway_engine_priority import _recording
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.extproc import Processor, start
from tokenpools.model.config import parse_config
from tokenpools.model.objectives import engine_priority
from tokenpools.model.service_class import ServiceClass


@pytest.mark.parametrize("request_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_the_engine_behind_envoy_sees_the_class_priority(request_mode: str) -> None:
    seen: list[dict[str, Any]] = []
    app: web.Application = make_emulator(FAST, 1.0, "priority")
    app.middlewares.append(_recording(seen))
    engine = ServerThread(app)
    loop = LoopThread()
    picker = Picker([f"127.0.0.1:{engine.port}"])
    _, picker_port = loop.run(start_grpc(picker))
    data = config_data("http://127.0.0.1:9")
    data["pools"][0]["schedulingPolicy"] = "priority"
    processor = Processor(parse_config(data), access_log=False)
    running = loop.run(start(processor, port=0, http_port=0))
    envoy = start_envoy(running.grpc_port, picker_port, request_mode=request_mode)
    try:
        for who, service_class in (("gold", ServiceClass.GUARANTEED), ("spot", ServiceClass.SPOT)):
            api = openai.OpenAI(base_url=f"{envoy.url}/v1", api_key=KEYS[who])
            reply = api.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                extra_body={"priority": -1000},  # a client trying to jump the queue
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 3
            assert seen[-1]["priority"] == engine_priority(service_class)
        snapshot = lambda: processor.admission.snapshot(0.0).entitlements  # noqa: E731
        wait_for(
            lambda: {n: e.in_flight for n, e in snapshot().items() if e.in_flight},
            lambda held: not held,
            what="every lease ended",
        )
    finally:
        envoy.stop()
        engine.stop()
