"""The ext_proc processor through a real Envoy, on the parts that make it a tenant control
plane and a service: layered entitlements spilling guaranteed -> spot (and the picker told the
band of each), an expired key, a budget's insufficient_quota, gRPC health and Prometheus
metrics, and the processor killed and restarted under load (fail closed while it is away)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.servers import wait_for
from tests.stacks import Stack, stack_of
from tests.test_tenants import CHAT, tenants_config
from tokenpools.extproc import Processor, start
from tokenpools.model.config import parse_config
from tokenpools.model.objectives import FAIRNESS_HEADER, OBJECTIVE_HEADER


@pytest.fixture
def stack() -> Iterator[Stack]:
    config = tenants_config("http://127.0.0.1:9")
    config["budgets"] = [{"name": "other-cap", "tenant": "other", "limit": 40, "window": "day"}]
    yield from stack_of(config)


def test_guaranteed_spills_to_spot_and_the_picker_hears_each_band(stack: Stack) -> None:
    acme = openai.OpenAI(base_url=f"{stack.envoy.url}/v1", api_key="sk-acme", max_retries=0)
    held = []
    for _ in range(2):  # acme-gold's two slots
        raw = acme.chat.completions.with_raw_response.create(
            model=CHAT, messages=[{"role": "user", "content": "go"}], max_tokens=2000, stream=True
        )
        assert raw.headers["x-tokenpools-entitlement"] == "acme-gold"
        stream = raw.parse()
        next(iter(stream))
        held.append(stream)
    spilled = acme.chat.completions.with_raw_response.create(
        model=CHAT, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert spilled.headers["x-tokenpools-entitlement"] == "acme-spot"
    assert spilled.headers["x-tokenpools-service-class"] == "spot"
    bands = [(s[OBJECTIVE_HEADER], s[FAIRNESS_HEADER]) for s in stack.picker.seen]
    assert bands == [("chat-guaranteed", "acme")] * 2 + [("chat-spot", "acme")]
    for s in held:
        s.close()


def test_an_expired_key_and_an_exhausted_budget(stack: Stack) -> None:
    url = f"{stack.envoy.url}/v1"
    with pytest.raises(openai.AuthenticationError) as expired:
        openai.OpenAI(base_url=url, api_key="sk-acme-old", max_retries=0).models.list()
    assert expired.value.status_code == 401
    other = openai.OpenAI(base_url=url, api_key="sk-other", max_retries=0)
    with pytest.raises(openai.RateLimitError) as broke:
        for _ in range(10):  # 40 tokens a day: a few requests spend it
            other.chat.completions.create(
                model=CHAT, messages=[{"role": "user", "content": "x"}], max_tokens=8
            )
    assert broke.value.body["code"] == "insufficient_quota"  # type: ignore[index]
    assert broke.value.response.headers["x-tokenpools-budget"] == "other-cap"
    assert int(broke.value.response.headers["retry-after"]) >= 1


def test_grpc_health_and_metrics(stack: Stack) -> None:
    acme = openai.OpenAI(base_url=f"{stack.envoy.url}/v1", api_key="sk-acme", max_retries=0)
    acme.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    with grpc.insecure_channel(f"127.0.0.1:{stack.processor.grpc_port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            answer = wait_for(
                lambda s=service: check(health_pb2.HealthCheckRequest(service=s)).status,  # type: ignore[misc]
                lambda status: status == health_pb2.HealthCheckResponse.SERVING,
                what=f"{service or 'the server'} serving",
            )
            assert answer == health_pb2.HealthCheckResponse.SERVING
    http = f"http://127.0.0.1:{stack.processor.http_port}"
    assert httpx.get(f"{http}/readyz").status_code == 200
    metrics = httpx.get(f"{http}/metrics").text
    assert 'tokenpools_admitted_total{class="guaranteed",entitlement="acme-gold"' in metrics
    assert "tokenpools_store_up 1.0" in metrics


def test_the_processor_killed_and_restarted_under_load_fails_closed(stack: Stack) -> None:
    """While the processor is away Envoy admits nothing (failure_mode_allow false): every
    request is refused, none reaches the picker. Restarted on its port, it admits again, and
    no lease is left held by the one that died."""
    url = f"{stack.envoy.url}/v1/chat/completions"
    body = {"model": CHAT, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    key = {"Authorization": "Bearer sk-acme"}
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                statuses.append(http.post(url, json=body, headers=key).status_code)

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    wait_for(lambda: statuses.count(200), lambda n: n >= 20, what="load admitted")
    port = stack.processor.grpc_port
    stack.loop.run(stack.processor.stop(0))
    stack.picker.seen.clear()
    before = len(statuses)
    wait_for(lambda: statuses[before:], lambda s: len(s) >= 20, what="requests while it is away")
    away = statuses[before + 4 :]  # those already past the processor may still finish
    assert away and all(status >= 500 for status in away), away
    config = parse_config(tenants_config("http://127.0.0.1:9"))
    stack.processor = stack.loop.run(
        start(Processor(config, access_log=False), port=port, http_port=0)
    )
    again = len(statuses)
    wait_for(lambda: statuses[again:].count(200), lambda n: n >= 20, what="admitting again")
    stop.set()
    for w in workers:
        w.join(10)
