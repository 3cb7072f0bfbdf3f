"""The gateway end to end: real loopback sockets, the emulator as backend, the official openai
client. After every test the gateway's in-flight and reserved counters are back to zero,
asserted through the admin API."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.gateway_setup import (
    KEYS,
    MODEL,
    admin,
    client,
    config_data,
    emulator_running,
)
from tests.servers import ServerThread, wait_until
from tokenpools.admission.config_file import reload_from
from tokenpools.gateway.app import GATEWAY, Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key
from tokenpools.processes import free_port


def test_non_streaming_chat_and_completion(gateway: ServerThread) -> None:
    c = client(gateway)
    reply = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5
    )
    assert reply.choices[0].message.content == "tok " * 5
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    text = c.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
    assert text.usage is not None and text.usage.completion_tokens == 3
    assert [m.id for m in c.models.list()] == [MODEL]


def test_streaming_strips_the_usage_chunk_unless_asked(gateway: ServerThread) -> None:
    c = client(gateway)
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
        )
    )
    assert all(ch.usage is None for ch in chunks)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 6
    with_usage = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 6


def test_error_shapes(gateway: ServerThread) -> None:
    with pytest.raises(openai.AuthenticationError) as auth:
        client(gateway, max_retries=0).with_options(api_key="sk-wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert auth.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        client(gateway).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    headers = {"Authorization": f"Bearer {KEYS['gold']}", "Content-Type": "application/json"}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]})
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=huge, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    # A request that can never fit its entitlement is a 400, not a 429 to retry forever.
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 90000},
        headers=headers,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "exceeds_entitlement"


def test_bad_input_gets_a_clear_error_in_the_openai_shape(gateway: ServerThread) -> None:
    headers = {"Authorization": f"Bearer {KEYS['gold']}", "Content-Type": "application/json"}
    before = httpx.get(f"{gateway.url}/metrics").text
    deep = (
        b"[" * 20_000 + b"]" * 20_000
    )  # within the size limit; Python's parser alone would hit RecursionError
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=deep, headers=headers)
    assert r.status_code == 400 and "nests deeper than 64" in r.json()["error"]["message"]
    nested: object = "x"
    for _ in range(70):
        nested = [nested]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "metadata": nested}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={**chat, "n": 9}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "at most 8" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={**chat, "n": 0}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "best_of": "3"},
        headers=headers,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = httpx.get(f"{gateway.url}/v1/no/such/path", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{gateway.url}/v1/chat/completions", headers=headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["Allow"]
    # Refused before admission: nothing was reserved, so every counter is as it was.
    reserved = [line for line in before.splitlines() if "in_flight{" in line]
    after = httpx.get(f"{gateway.url}/metrics").text
    assert reserved and reserved == [line for line in after.splitlines() if "in_flight{" in line]


def test_a_pool_with_no_healthy_backend_answers_503_with_retry_after() -> None:
    gw = Gateway(parse_config(config_data(f"http://127.0.0.1:{free_port()}")))  # nothing there
    server = ServerThread(make_app(gw, health_interval_s=60))
    try:
        backends = [b for pool in gw.pools.values() for b in pool.backends]
        wait_until(lambda: not any(b.healthy for b in backends))  # the first health check
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": f"Bearer {KEYS['gold']}"},
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend"
        assert r.headers["Retry-After"] == "60"
        assert all(e["in_flight"] == 0 for e in admin(server, "entitlements").values())
    finally:
        server.stop()


_CLIENTS: list[httpx.Client] = []


@dataclass
class Stream:
    response: httpx.Response
    lines: Iterator[str]  # keep it: a collected line iterator closes the response

    def rest(self) -> list[str]:
        return [line for line in self.lines if line]

    def close(self) -> None:
        self.response.close()


def open_streams(server: ServerThread, who: str, n: int, max_tokens: int = 400) -> list[Stream]:
    """Start n streams and read their first chunk, so they hold their leases."""
    http = httpx.Client(timeout=30)
    _CLIENTS.append(http)  # a collected client would close its streams
    streams = []
    for _ in range(n):
        request = http.build_request(
            "POST",
            f"{server.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "go"}],
                  "max_tokens": max_tokens, "stream": True},
            headers={"Authorization": f"Bearer {KEYS[who]}"},
        )  # fmt: skip
        response = http.send(request, stream=True)
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        streams.append(Stream(response, lines))
    return streams


def test_429_carries_retry_after_and_ratelimit_headers(gateway: ServerThread) -> None:
    streams = open_streams(gateway, "gold", 4)  # gold's whole concurrency
    with pytest.raises(openai.RateLimitError) as limited:
        client(gateway, max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
    headers = limited.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "4"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert limited.value.body["code"] == "concurrency_limit"  # type: ignore[index]
    for s in streams:
        s.close()


def test_the_client_honours_retry_after_and_then_succeeds(gateway: ServerThread) -> None:
    streams = open_streams(gateway, "gold", 4, max_tokens=30)  # ~0.6 s of output left
    start = time.monotonic()
    reply = client(gateway, max_retries=3).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    assert time.monotonic() - start >= 0.9  # it waited for Retry-After (1 s) before retrying
    for s in streams:
        s.rest()
        s.close()


def test_client_disconnect_releases_the_lease_and_cancels_upstream(
    gateway: ServerThread, emulator: ServerThread
) -> None:
    (stream,) = open_streams(gateway, "gold", 1, max_tokens=2000)
    assert admin(gateway, "entitlements")["gold"]["in_flight"] == 1
    assert emulator_running(emulator) == 1
    stream.close()
    wait_until(lambda: admin(gateway, "entitlements")["gold"]["in_flight"] == 0)
    wait_until(lambda: emulator_running(emulator) == 0)


def test_a_backend_killed_mid_stream_ends_the_stream_with_an_error(
    gateway: ServerThread, emulator: ServerThread
) -> None:
    (stream,) = open_streams(gateway, "gold", 1, max_tokens=5000)
    emulator.kill()
    lines = stream.rest()
    stream.close()
    assert any("backend_error" in line for line in lines)
    wait_until(lambda: admin(gateway, "entitlements")["gold"]["in_flight"] == 0)
    # With the backend gone, a new request gets 502/503, and still no lease leaks.
    with pytest.raises(openai.APIStatusError) as down:
        client(gateway, max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert down.value.status_code in (502, 503)


def test_hot_reload_valid_and_invalid(
    gateway: ServerThread, emulator: ServerThread, tmp_path: Path
) -> None:
    gw = gateway.app[GATEWAY]
    data = config_data(emulator.url)
    data["entitlements"].append(
        {"name": "newbie", "tenantId": "n", "pool": "pool", "serviceClass": "spot",
         "apiKeys": [hash_key("sk-newbie")]}
    )  # fmt: skip
    path = tmp_path / "tokenpools.yaml"
    path.write_text(yaml.safe_dump(data))
    assert gateway.call(lambda: reload_from(gw, path))
    newbie = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-newbie")
    assert (
        newbie.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
        ).usage
        is not None
    )
    path.write_text("pools: [oops\n")
    assert not gateway.call(lambda: reload_from(gw, path))
    assert (
        newbie.chat.completions.create(  # the old config keeps serving
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
        ).usage
        is not None
    )


def test_metrics_and_health(gateway: ServerThread) -> None:
    client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    text = httpx.get(f"{gateway.url}/metrics").text
    assert (
        'tokenpools_admitted_total{class="guaranteed",entitlement="gold",pool="pool",'
        'tenant="g"} 1.0' in text
    )
    assert 'tokenpools_credential_requests_total{credential="gold",tenant="g"} 1.0' in text
    assert "tokenpools_priority{" in text and "tokenpools_pool_capacity{" in text
    assert httpx.get(f"{gateway.url}/healthz").status_code == 200
    wait_until(lambda: httpx.get(f"{gateway.url}/readyz").status_code == 200)
    assert httpx.get(f"{gateway.url}/admin/pools").status_code == 401
