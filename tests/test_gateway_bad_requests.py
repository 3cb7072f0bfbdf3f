"""Bad requests through the real gateway, hand-written and generated: whatever arrives, the
answer is never a 5xx, every error has the OpenAI shape, and afterwards nothing is in flight
or reserved (read through the admin API)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway_setup import FAST, KEYS, MODEL, admin, config_data, wait_all_ended
from tests.servers import ServerThread
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"]


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerThread, httpx.Client]]:
    emulator = ServerThread(make_emulator(FAST, speed=0))  # no delay: generated requests are many
    gateway = ServerThread(make_app(Gateway(parse_config(config_data(emulator.url)))))
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        yield gateway, http
    wait_all_ended(gateway)
    for e in admin(gateway, "entitlements").values():
        assert e["reserved"] == {"concurrency": 0, "kv_tokens": 0}, e
    for p in admin(gateway, "pools").values():
        assert p["in_flight"] == 0 and p["reserved"] == {"concurrency": 0, "kv_tokens": 0}
    gateway.stop()
    emulator.stop()


def check(r: httpx.Response) -> None:
    """Never our failure; an error names itself in OpenAI's shape; an id to quote."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    assert r.headers.get("x-request-id") or r.status_code in (404, 405)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and set(error) >= {"param", "code"}


def auth(who: str = "gold") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


CHAT = "/v1/chat/completions"
ASK = {"model": MODEL, "messages": [{}]}  # what the cases below spoil one field of
HAND_WRITTEN: list[tuple[str, bytes | dict[str, Any], int, str | None]] = [
    # path, body (raw bytes, or JSON), expected status, the param the error names
    (CHAT, b"", 400, None),
    (CHAT, b"{", 400, None),
    (CHAT, b"\xff\xfe", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b"null", 400, None),
    (CHAT, b"[" * 100_000 + b"]" * 100_000, 413, None),
    (CHAT, b'{"a":' * 1000 + b"1" + b"}" * 1000, 400, None),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {"model": 3, "messages": []}, 400, "model"),
    (CHAT, {**ASK, "model": "nope"}, 404, "model"),
    (CHAT, {**ASK, "messages": ["hi"]}, 400, "messages"),
    (CHAT, {**ASK, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {**ASK, "max_tokens": True}, 400, "max_tokens"),
    (CHAT, {**ASK, "max_tokens": 10**9}, 400, "max_tokens"),
    (CHAT, {**ASK, "n": 1000}, 400, "n"),
    (CHAT, {**ASK, "best_of": "2"}, 400, "best_of"),
    (CHAT, {**ASK, "stream": "yes"}, 400, "stream"),
    (CHAT, {**ASK, "stream_options": 1}, 400, "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/embeddings", {"model": MODEL, "input": []}, 400, "input"),
    ("/v1/responses", {"model": MODEL, "input": ""}, 400, "input"),
    ("/v1/responses", {"model": MODEL, "input": [1]}, 400, "input"),
    (
        "/v1/responses",
        {"model": MODEL, "input": "x", "max_output_tokens": 0},
        400,
        "max_output_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), HAND_WRITTEN)
def test_hand_written_bad_bodies(
    servers: tuple[ServerThread, httpx.Client],
    path: str,
    body: bytes | dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    _, http = servers
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=raw, headers=auth())
    check(r)
    assert r.status_code == status, r.text[:300]
    assert r.json()["error"]["param"] == param


def test_bad_keys_paths_and_methods(servers: tuple[ServerThread, httpx.Client]) -> None:
    _, http = servers
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic abc"}, auth("admin")):
        r = http.post(CHAT, json=body, headers=headers)
        check(r)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = http.get("/v1/chat/completions", headers=auth())
    check(r)
    assert r.status_code == 405 and r.headers["Allow"] == "POST"
    r = http.post("/v1/nothing-here", json=body, headers=auth())
    check(r)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.post("/admin/pools", headers=auth("admin"))
    check(r)
    assert r.status_code == 405


# -- generated -------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
small_ints = st.integers(-3, 40) | st.just(10**7) | st.booleans() | st.text(max_size=3) | st.none()
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool"]) | json_values,
        "content": st.text(max_size=60)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}))
        | json_values,
        "tool_calls": json_values,
    },
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just(MODEL) | json_values,
        "messages": st.lists(message, max_size=3) | json_values,
        "prompt": st.text(max_size=40) | st.lists(st.integers(0, 5000), max_size=20) | json_values,
        "input": st.text(max_size=40) | st.lists(message, max_size=2) | json_values,
        "max_tokens": small_ints,
        "max_output_tokens": small_ints,
        "max_completion_tokens": small_ints,
        "n": small_ints,
        "best_of": small_ints,
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
        "tools": json_values,
        "instructions": st.text(max_size=30) | json_values,
    },
)
header_text = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40)
headers = st.fixed_dictionaries(
    {},
    optional={
        "Authorization": st.sampled_from([f"Bearer {k}" for k in KEYS.values()]) | header_text,
        "x-request-id": header_text,
        "traceparent": header_text,
        "Content-Type": st.sampled_from(["application/json", "text/plain"]) | header_text,
        "Content-Encoding": st.sampled_from(["gzip", "identity"]),
    },
)


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(PATHS), body=bodies, extra=headers, who=st.sampled_from(list(KEYS)))
def test_generated_bodies_and_headers(
    servers: tuple[ServerThread, httpx.Client],
    path: str,
    body: dict[str, Any],
    extra: dict[str, str],
    who: str,
) -> None:
    _, http = servers
    sent = auth(who) | extra
    if "model" in body and body["model"] == MODEL and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 64)  # keep the valid ones quick
    raw = json.dumps(body).encode()
    if sent.get("Content-Encoding") == "gzip":  # a compressed body is read as its JSON
        raw = gzip.compress(raw)
    check(http.post(path, content=raw, headers=sent))


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=200))
def test_generated_raw_bytes(
    servers: tuple[ServerThread, httpx.Client], path: str, raw: bytes
) -> None:
    _, http = servers
    check(http.post(path, content=raw, headers=auth()))
