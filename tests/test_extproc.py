"""The ext_proc processor through a real Envoy: tokenpools' filter, then an endpoint picker
that follows the EPP protocol, then emulated vLLM backends; the official openai client in
front. Every admission outcome the gateway's tests cover, the headers the data plane sees,
streams and whole answers settled on the engine's usage, and leases ended on every ending."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.envoy_setup import Envoy, LoopThread, Picker, start_envoy, start_grpc
from tests.gateway_setup import FAST, KEYS, MODEL, config_data
from tests.servers import ServerThread, wait_for
from tokenpools.emulator.server import make_app as make_emulator
from tokenpools.extproc import Processor, Running, start
from tokenpools.model.config import parse_config
from tokenpools.model.objectives import FAIRNESS_HEADER, OBJECTIVE_HEADER


@dataclass
class Stack:
    envoy: Envoy
    processor: Running
    picker: Picker
    backends: list[ServerThread]
    loop: LoopThread

    def client(self, who: str = "gold", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.envoy.url}/v1", api_key=KEYS[who], **kw)

    def in_flight(self) -> dict[str, int]:
        snap = self.processor.processor.admission.snapshot(0.0)
        return {name: e.in_flight for name, e in snap.entitlements.items() if e.in_flight}

    def wait_all_ended(self) -> None:
        wait_for(self.in_flight, lambda v: not v, what="every lease ended")


def stack_of(config: dict[str, Any], backends: int = 2) -> Iterator[Stack]:
    servers = [ServerThread(make_emulator(FAST, speed=1.0)) for _ in range(backends)]
    loop = LoopThread()
    picker = Picker([f"127.0.0.1:{s.port}" for s in servers])
    picker_server, picker_port = loop.run(start_grpc(picker))
    processor = Processor(parse_config(config), access_log=False)
    running = loop.run(start(processor, port=0, http_port=0))
    envoy = start_envoy(running.grpc_port, picker_port)
    stack = Stack(envoy, running, picker, servers, loop)
    try:
        yield stack
        stack.wait_all_ended()
    finally:
        envoy.stop()
        loop.run(running.stop(0.5))
        loop.run(picker_server.stop(0))
        loop.stop()
        for s in servers:
            s.stop()


@pytest.fixture
def stack() -> Iterator[Stack]:
    yield from stack_of(config_data("http://127.0.0.1:9"))


def test_admitted_request_reaches_a_picked_backend_with_its_class(stack: Stack) -> None:
    answer = stack.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    completion = answer.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert answer.headers["x-tokenpools-entitlement"] == "gold"
    assert answer.headers["x-tokenpools-service-class"] == "guaranteed"
    assert "x-ratelimit-remaining-requests" in answer.headers
    seen = stack.picker.seen[-1]
    assert seen[OBJECTIVE_HEADER] == "pool-guaranteed"
    assert seen[FAIRNESS_HEADER] == "g"
    assert "authorization" not in seen  # the tenant's key stays with tokenpools
    stack.wait_all_ended()


def test_unknown_key_is_401_without_reaching_the_picker(stack: Stack) -> None:
    r = httpx.post(
        f"{stack.envoy.url}/v1/chat/completions",
        headers={"Authorization": "Bearer sk-nobody"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert stack.picker.seen == []
