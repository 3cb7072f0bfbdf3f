"""The endpoints beyond chat and completions (embeddings, the Responses API, one model), and what
the gateway reports of each request: token counters and GenAI latency histograms in /metrics,
one access-log line per request, readiness that covers backends and the shared store."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway_setup import KEYS, MODEL, admin, client, config_data
from tests.servers import ServerThread, wait_until
from tests.test_hostile_input import send
from tokenpools.admission.access_log import JsonFormatter
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.processes import free_port

ROOT = Path(__file__).parent.parent


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_embeddings_are_admitted_on_their_input_and_settle(gateway: ServerThread) -> None:
    reply = client(gateway).embeddings.create(model=MODEL, input=["one text", "another text"])
    assert len(reply.data) == 2 and len(reply.data[0].embedding) == 8
    assert reply.usage.prompt_tokens > 0
    text = httpx.get(f"{gateway.url}/metrics").text
    assert sample(text, "tokenpools_prompt_tokens_total", entitlement="gold") == (
        reply.usage.prompt_tokens
    )
    assert sample(text, "tokenpools_completion_tokens_total", entitlement="gold") == 0
    r = httpx.post(
        f"{gateway.url}/v1/embeddings",
        json={"model": MODEL, "input": "x", "stream": True},
        headers={"Authorization": f"Bearer {KEYS['gold']}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_responses_api_settles_on_its_usage_streaming_or_not(gateway: ServerThread) -> None:
    c = client(gateway)
    reply = c.responses.create(model=MODEL, input="say something", max_output_tokens=6)
    assert reply.usage is not None and reply.usage.output_tokens == 6
    assert reply.output_text == "tok " * 6
    events = list(
        c.responses.create(
            model=MODEL,
            instructions="be brief",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
            max_output_tokens=5,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 5
    text = httpx.get(f"{gateway.url}/metrics").text
    assert sample(text, "tokenpools_completion_tokens_total", entitlement="gold") == 11
    assert sample(text, "gen_ai_server_time_to_first_token_seconds_count", entitlement="gold") == 1
    assert (
        sample(text, "gen_ai_server_time_per_output_token_seconds_count", entitlement="gold") == 1
    )
    assert sample(text, "gen_ai_server_request_duration_seconds_count", entitlement="gold") == 2


def test_a_responses_stream_cut_by_the_client_settles(gateway: ServerThread) -> None:
    stream = client(gateway).responses.create(
        model=MODEL, input="long", max_output_tokens=300, stream=True
    )
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()  # the fixture checks every counter is back to zero


def test_one_model_by_name(gateway: ServerThread) -> None:
    c = client(gateway)
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        c.models.retrieve("some-other-model")
    assert err.value.code == "model_not_found"
    r = httpx.get(f"{gateway.url}/v1/models/{MODEL}")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_one_access_log_line_per_request_in_json(
    gateway: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tokenpools.access"):
        client(gateway).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_headers={"x-request-id": "abc-123"},
        )
        httpx.post(f"{gateway.url}/v1/chat/completions", headers={"Authorization": "Bearer no"})
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records]
    assert [line["status"] for line in lines] == [200, 401]
    ok = lines[0]
    assert ok["request_id"] == "abc-123" and ok["entitlement"] == "gold"
    assert ok["decision"] == "admitted" and ok["completion_tokens"] == 4
    assert ok["path"] == "/v1/chat/completions" and ok["duration_s"] >= ok["ttft_s"] > 0
    assert lines[1]["request_id"].startswith("req_") and "entitlement" not in lines[1]


def test_metrics_export_desired_replicas_and_backend_health(gateway: ServerThread) -> None:
    text = httpx.get(f"{gateway.url}/metrics").text
    assert sample(text, "tokenpools_desired_replicas", pool="pool") >= 1
    assert sample(text, "tokenpools_backend_healthy", pool="pool") == 1
    assert sample(text, "tokenpools_store_up") == 1
    assert "tokenpools_tokenizer_fallbacks_total" in text


def test_the_grafana_dashboard_reads_only_metrics_the_gateway_exports(
    gateway: ServerThread,
) -> None:
    c = client(gateway)
    c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    ).close()
    with pytest.raises(openai.BadRequestError):  # a refusal, so its counter has a series
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                  max_tokens=10**6)  # fmt: skip
    send(gateway.url, b"G@T / HTTP/1.1\r\n\r\n")  # refused by the HTTP parser: counted
    text = httpx.get(f"{gateway.url}/metrics").text
    series = {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if not line.startswith("#")
    }
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "tokenpools-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:tokenpools|gen_ai)_[a-z_]+)", e)}
    assert len(exprs) >= 16 and used
    assert used <= series, used - series


def test_readyz_says_what_is_missing() -> None:
    data = config_data(f"http://127.0.0.1:{free_port()}")  # nobody listens there
    data["state"] = {"backend": "redis", "url": f"redis://127.0.0.1:{free_port()}/0"}
    gw = ServerThread(make_app(Gateway(parse_config(data)), health_interval_s=0.1))
    try:
        wait_until(lambda: "no healthy backend for pool pool" in httpx.get(f"{gw.url}/readyz").text)
        r = httpx.get(f"{gw.url}/readyz", timeout=10)
        assert r.status_code == 503 and "the shared state store does not answer" in r.text
        assert httpx.get(f"{gw.url}/healthz").status_code == 200  # alive, not ready
    finally:
        gw.stop()


def test_readyz_is_ready_with_a_backend_and_no_shared_store(gateway: ServerThread) -> None:
    r = httpx.get(f"{gateway.url}/readyz")
    assert r.status_code == 200, r.text
    assert admin(gateway, "pools")["pool"]["backends"][0]["healthy"]
