"""What the gateway sends upstream and passes back, against a backend that checks it: the
backend's API key (from an environment variable or a file, re-read on reload), the model name
it serves, x-request-id both ways, the trace context, the backend's own headers (hop-by-hop
ones excepted), and OpenAI's x-ratelimit-* headers on every answer, read through the official
client's raw responses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict

from tests.gateway_setup import KEYS, MODEL, admin, config_data
from tests.servers import ServerThread
from tokenpools.admission.config_file import reload_from
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.gateway.tracing import Tracing
from tokenpools.model.config import ConfigError, parse_config

SERVED = "org/the-model-v2"  # what the backend calls the model clients know as MODEL
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class CheckingBackend:
    """An OpenAI-style backend that refuses what a secured vLLM would: a wrong key (401) or a
    model name it does not serve (404); it keeps the headers of every request it saw."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.seen: list[CIMultiDict[str]] = []
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        self.server = ServerThread(app)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(self, request: web.Request) -> web.Response:
        self.seen.append(CIMultiDict(request.headers))
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        if body["model"] != SERVED:
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        reply = {"id": "c1", "object": "chat.completion", "created": 0, "model": SERVED,
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": "hi"}}],
                 "usage": usage}  # fmt: skip
        headers = {"openai-processing-ms": "7", "x-backend": "checker", "Keep-Alive": "timeout=5"}
        return web.json_response(reply, headers=headers)


def upstream_config(url: str, **backend: Any) -> dict[str, Any]:
    data = config_data(url)
    data["pools"][0]["backends"] = [{"url": url, "model": SERVED, **backend}]
    return data


@pytest.fixture
def backend() -> Iterator[CheckingBackend]:
    b = CheckingBackend("sk-upstream-1")
    yield b
    b.server.stop()


def chat(server: ServerThread, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={"Authorization": f"Bearer {KEYS['gold']}", **headers},
    )


def test_key_model_request_id_and_trace_reach_the_backend(
    backend: CheckingBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TP_UPSTREAM_KEY", "sk-upstream-1")
    gw = ServerThread(
        make_app(
            Gateway(parse_config(upstream_config(backend.server.url, apiKeyEnv="TP_UPSTREAM_KEY")))
        )
    )
    try:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEYS["gold"], max_retries=0)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_headers={"traceparent": TRACE},
        )
        assert raw.parse().usage is not None and raw.parse().usage.completion_tokens == 3
        sent = backend.seen[-1]
        assert sent["Authorization"] == "Bearer sk-upstream-1"  # not the client's key
        assert sent["traceparent"] == TRACE
        rid = raw.headers["x-request-id"]
        assert rid.startswith("req_") and sent["x-request-id"] == rid
        assert raw.headers["openai-processing-ms"] == "7" and raw.headers["x-backend"] == "checker"
        assert "keep-alive" not in {k.lower() for k in raw.headers}  # hop-by-hop: not passed
        # A client's own request id is kept, both ways.
        r = chat(gw, **{"x-request-id": "my-trace-42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "my-trace-42"
        assert backend.seen[-1]["x-request-id"] == "my-trace-42"
        # Refused before admission: still an id, so the client can quote it.
        bad = httpx.post(
            f"{gw.url}/v1/chat/completions",
            content=b"{",
            headers={"Authorization": f"Bearer {KEYS['gold']}"},
        )
        assert bad.status_code == 400 and bad.headers["x-request-id"].startswith("req_")
        assert all(e["in_flight"] == 0 for e in admin(gw, "entitlements").values())
    finally:
        gw.stop()


def test_a_key_file_is_read_again_on_reload_and_a_missing_key_is_refused(
    backend: CheckingBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "upstream-key"
    secret.write_text("sk-upstream-1\n")
    config_file = tmp_path / "tokenpools.yaml"
    config_file.write_text(
        yaml.safe_dump(upstream_config(backend.server.url, apiKeyFile=str(secret)))
    )
    gateway = Gateway(parse_config(yaml.safe_load(config_file.read_text())))
    gw = ServerThread(make_app(gateway))
    try:
        assert chat(gw).status_code == 200
        backend.key = "sk-upstream-2"  # the backend rotates its key, then the Secret follows
        refused = chat(gw)  # not the client's fault: a 502 that says whose key it was
        assert refused.status_code == 502 and refused.json()["error"]["code"] == "backend_auth"
        secret.write_text("sk-upstream-2")
        assert gw.call(lambda: reload_from(gateway, config_file)) is True
        assert (
            chat(gw).status_code == 200
            and backend.seen[-1]["Authorization"] == "Bearer sk-upstream-2"
        )
        # A reload whose key cannot be read is refused; the running config goes on serving.
        config_file.write_text(
            yaml.safe_dump(upstream_config(backend.server.url, apiKeyEnv="TP_NOT_SET"))
        )
        monkeypatch.delenv("TP_NOT_SET", raising=False)
        assert gw.call(lambda: reload_from(gateway, config_file)) is False
        assert chat(gw).status_code == 200
    finally:
        gw.stop()
    with pytest.raises(ConfigError, match="TP_NOT_SET"):
        Gateway(parse_config(upstream_config(backend.server.url, apiKeyEnv="TP_NOT_SET")))


def test_a_wrong_model_mapping_is_the_backends_404_and_releases_the_lease(
    backend: CheckingBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TP_UPSTREAM_KEY", "sk-upstream-1")
    data = upstream_config(backend.server.url, apiKeyEnv="TP_UPSTREAM_KEY")
    data["pools"][0]["backends"][0]["model"] = "not-what-it-serves"
    gw = ServerThread(make_app(Gateway(parse_config(data))))
    try:
        r = chat(gw)
        assert r.status_code == 404 and backend.seen[-1]["Authorization"] == "Bearer sk-upstream-1"
        e = admin(gw, "entitlements")["gold"]
        assert e["in_flight"] == 0 and e["reserved"] == {"concurrency": 0, "kv_tokens": 0}
    finally:
        gw.stop()


def test_every_decided_answer_carries_numeric_rate_limit_headers(gateway: ServerThread) -> None:
    c = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["gold"], max_retries=0)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    h = raw.headers
    # gold: a guaranteed entitlement of 4 in flight; this request held one when it was decided
    assert h["x-ratelimit-limit-requests"] == "4" and h["x-ratelimit-remaining-requests"] == "3"
    assert h["x-ratelimit-reset-requests"] == "0.000s"
    limit, left = int(h["x-ratelimit-limit-tokens"]), int(h["x-ratelimit-remaining-tokens"])
    assert 0 <= left < limit  # its bucket paid for this request
    assert 0 <= float(h["x-ratelimit-reset-tokens"].removesuffix("s")) < 1  # refills fast
    # spot has no limits of its own: the pool's are shown
    spot = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEYS["spot"], max_retries=0)
    with spot.chat.completions.with_streaming_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    ) as streamed:
        assert streamed.headers["x-ratelimit-limit-requests"] == "8"  # the pool's 8 slots
        assert int(streamed.headers["x-ratelimit-remaining-tokens"]) >= 0
        assert sum(1 for line in streamed.iter_lines() if line.startswith("data:")) >= 3


def test_a_span_per_request_joins_the_clients_trace_and_parents_the_backends(
    backend: CheckingBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    monkeypatch.setenv("TP_UPSTREAM_KEY", "sk-upstream-1")
    config = parse_config(upstream_config(backend.server.url, apiKeyEnv="TP_UPSTREAM_KEY"))
    gw = ServerThread(make_app(Gateway(config, tracing=Tracing(provider.get_tracer("test")))))
    try:
        assert chat(gw, traceparent=TRACE).status_code == 200
        assert chat(gw, **{"Authorization": "Bearer wrong"}).status_code == 401
    finally:
        gw.stop()
    ok, refused = exported.get_finished_spans()
    assert ok.name == f"chat {MODEL}" and refused.name == "chat"
    assert ok.context is not None and ok.parent is not None
    assert f"{ok.context.trace_id:032x}" == TRACE.split("-")[1]  # the client's trace
    assert ok.attributes is not None and refused.attributes is not None
    assert ok.attributes["gen_ai.usage.input_tokens"] == 7  # the backend's usage
    assert ok.attributes["gen_ai.usage.output_tokens"] == 3
    assert ok.attributes["tokenpools.decision"] == "admitted"
    assert refused.attributes["http.response.status_code"] == 401
    # The backend's parent is the gateway's span, in the same trace.
    sent = backend.seen[-1]["traceparent"].split("-")
    assert sent[1] == TRACE.split("-")[1] and sent[2] == f"{ok.context.span_id:016x}"
