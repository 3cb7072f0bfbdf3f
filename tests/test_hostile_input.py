"""Any bytes a client sends get a clean answer, generated rather than listed: JWT headers and
claims of every JSON type (and not JSON at all), signed with every algorithm against every key
type the JWKS serves (RSA, EC) or with none; API keys and trusted headers of arbitrary bytes;
raw HTTP/1.1 requests with hostile framing sent over a socket. The property, for each: a 4xx
in OpenAI's error shape (or the request served, where the draw happens to be valid), nothing
logged at ERROR, nothing of what was sent echoed back, and the gateway still serves. On the
memory store and on Redis. Examples per test in CI: the `max_examples` below."""

from __future__ import annotations

import base64
import json
import logging
import secrets
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway_setup import FAST
from tests.servers import ServerThread
from tests.test_jwt import AUDIENCE, ISSUER, Idp
from tests.test_tenants import CHAT, tenants_config
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key

PROXY_SECRET = "proxy-s3cret"
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def idp() -> Iterator[Idp]:
    provider = Idp()
    provider.new_key("k1")
    provider.new_key("e1", "ec")
    yield provider
    provider.server.stop()


@pytest.fixture(scope="module", params=["memory", "redis"])
def server(request: pytest.FixtureRequest, idp: Idp) -> Iterator[ServerThread]:
    backend = ServerThread(make_emulator(FAST, speed=1.0))
    jwks = f"{idp.server.url}/jwks.json"
    jwt_settings = {"issuer": ISSUER, "audience": AUDIENCE, "jwksUrl": jwks,
                    "modelsClaim": "models", "refreshMinIntervalS": 30}  # fmt: skip
    trusted = {"secretHeader": "x-proxy-secret", "secretHash": hash_key(PROXY_SECRET)}
    data = tenants_config(backend.url, jwt=jwt_settings, trustedHeader=trusted)
    if request.param == "redis":
        data["state"] = {"backend": "redis", "url": request.getfixturevalue("redis_url"),
                         "keyPrefix": secrets.token_hex(4)}  # fmt: skip
    gateway = ServerThread(make_app(Gateway(parse_config(data))))
    yield gateway
    gateway.stop()
    backend.stop()


# -- what every answer must be ------------------------------------------------------------------


def clean(status: int, body: bytes, sent: list[bytes], errors: list[logging.LogRecord]) -> None:
    assert status < 500, (status, body[:300])
    if status >= 400:
        error = json.loads(body)["error"]
        assert {"message", "type", "code"} <= set(error) and isinstance(error["message"], str)
    for part in sent:  # a distinctive piece of what was sent never comes back
        if len(part) >= 12:
            assert part not in body, (part, body[:300])
    assert not errors, [r.getMessage()[:200] for r in errors]


def logged_errors(caplog_records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in caplog_records if r.levelno >= logging.ERROR]


def still_serves(server: ServerThread) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": CHAT, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2},
                   headers={"Authorization": "Bearer sk-acme"})  # fmt: skip
    assert r.status_code == 200, r.text


def chat_with(server: ServerThread, headers: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=30, headers=headers,
                      json={"model": CHAT, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2})  # fmt: skip


# -- JWTs ---------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
ALGS = st.sampled_from(["RS256", "ES256", "HS256", "PS256", "ES384", "EdDSA", "none", "RS512"])


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _json(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def tokens(draw: st.DrawFn, idp: Idp) -> str:
    """A token: its header and claims from every JSON type around plausible values, signed
    with a key of the JWKS (of either type, whatever the header claims), a random secret, or
    nothing; sometimes segments that are not JSON, or not base64."""
    header: dict[str, Any] = {
        "alg": draw(ALGS | JSON),
        "kid": draw(st.sampled_from(["k1", "e1"]) | JSON),
    }
    header |= draw(
        st.dictionaries(
            st.sampled_from(["typ", "crit", "jku", "x5u", "cty", "b64"]), JSON, max_size=2
        )
    )
    if draw(st.booleans()):
        header = draw(JSON)  # not even an object
    now = time.time()
    times = st.sampled_from([now + 300, now - 9999, float("inf"), float("nan"), 1e308, -1]) | JSON
    claims: Any = {
        "iss": draw(st.just(ISSUER) | JSON),
        "aud": draw(st.just(AUDIENCE) | JSON),
        "tenant": draw(st.sampled_from(["acme", "other", "nobody"]) | JSON),
        "exp": draw(times),
        "nbf": draw(times),
        "iat": draw(times),
        "models": draw(JSON),
    }
    if draw(st.booleans()):
        claims = draw(JSON)
    segments = [b64(_json(header)), b64(_json(claims))]
    signing = f"{segments[0]}.{segments[1]}".encode()
    how = draw(st.sampled_from(["rsa", "ec", "secret", "random", "empty", "garbage"]))
    if how == "rsa":
        sig = jwt.get_algorithm_by_name("RS256").sign(signing, idp.keys["k1"])
    elif how == "ec":
        sig = jwt.get_algorithm_by_name("ES256").sign(signing, idp.keys["e1"])
    elif how == "secret":
        sig = jwt.get_algorithm_by_name("HS256").sign(
            signing, draw(st.binary(min_size=1, max_size=32))
        )
    elif how == "random":
        sig = draw(st.binary(max_size=300))
    else:
        sig = b""
    token = f"{segments[0]}.{segments[1]}.{b64(sig)}"
    if how == "garbage":  # still shaped like a JWT to reach the verifier
        token = (
            "eyJ"
            + draw(st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=60))
            + ".a.b"
        )
    return token


@SETTINGS
@given(data=st.data())
def test_any_token_is_refused_cleanly_or_served(
    server: ServerThread, idp: Idp, data: st.DataObject, caplog: pytest.LogCaptureFixture
) -> None:
    token = data.draw(tokens(idp))
    caplog.clear()
    r = chat_with(server, {"Authorization": f"Bearer {token}"})
    assert r.status_code in (200, 401, 403, 404, 429), r.text
    clean(r.status_code, r.content, [], logged_errors(caplog.records))


def test_the_token_shapes_that_crashed_are_401s(server: ServerThread, idp: Idp) -> None:
    """The cases a reviewer found, pinned: a header field of the wrong type, an algorithm that
    does not fit its kid's key type, a crit extension, an exp that never comes."""

    def signed(header: dict[str, Any], claims: dict[str, Any], key: str, alg: str) -> str:
        h, c = b64(_json(header)), b64(_json(claims))
        sig = jwt.get_algorithm_by_name(alg).sign(f"{h}.{c}".encode(), idp.keys[key])
        return f"{h}.{c}.{b64(sig)}"

    good = {"iss": ISSUER, "aud": AUDIENCE, "tenant": "acme", "exp": time.time() + 300}
    cases = {
        "Key ID": signed({"alg": "RS256", "kid": ["k1"]}, good, "k1", "RS256"),
        "does not fit": signed({"alg": "ES256", "kid": "k1"}, good, "e1", "ES256"),
        "critical": signed(
            {"alg": "RS256", "kid": "k1", "crit": ["exp"], "exp": 1}, good, "k1", "RS256"
        ),
        "finite number": signed(
            {"alg": "RS256", "kid": "k1"}, {**good, "exp": float("inf")}, "k1", "RS256"
        ),
        "algorithm of type dict": signed({"alg": {"x": 1}, "kid": "k1"}, good, "k1", "RS256"),
    }
    for problem, token in cases.items():
        r = chat_with(server, {"Authorization": f"Bearer {token}"})
        assert r.status_code == 401, (problem, r.text)
        assert r.json()["error"]["code"] == "invalid_token"
        assert problem in r.json()["error"]["message"], (problem, r.json())
    fine = signed({"alg": "RS256", "kid": "k1"}, good, "k1", "RS256")
    assert chat_with(server, {"Authorization": f"Bearer {fine}"}).status_code == 200


# -- keys and trusted headers of arbitrary bytes ---------------------------------------------------

# What a header value may hold without breaking the framing (that is the next section's).
HEADER_BYTES = st.binary(min_size=1, max_size=200).map(
    lambda b: bytes(c for c in b if c not in (0, 10, 13)).strip() or b"x"
)


def send(url: str, raw: bytes) -> tuple[int, bytes]:
    """One raw request to the server at `url`; (status, body) of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(raw)  # not half-closed: the gateway takes that for a client gone
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1."), (raw[:200], answer[:200])
    status = int(head.split(b" ", 2)[1])
    return status, body


def chat_request(*headers: bytes, body: bytes | None = None) -> bytes:
    body = (
        body
        if body is not None
        else json.dumps(
            {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        ).encode()
    )
    lines = [
        b"POST /v1/chat/completions HTTP/1.1",
        b"Host: gw",
        b"Connection: close",
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
        *headers,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@SETTINGS
@given(key=HEADER_BYTES, tenant=HEADER_BYTES, secret=HEADER_BYTES | st.just(PROXY_SECRET.encode()))
def test_any_key_or_trusted_header_is_refused_cleanly(
    server: ServerThread, key: bytes, tenant: bytes, secret: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.clear()
    for headers in (
        [b"Authorization: Bearer " + key],
        [b"Authorization: " + key],
        [b"x-tokenpools-tenant: " + tenant, b"x-proxy-secret: " + secret],
    ):
        status, body = send(server.url, chat_request(*headers))
        # 400: bytes the HTTP parser refuses in a header value (control characters)
        assert status in (200, 400, 401, 403, 429), (headers, status, body[:300])
        if status == 400:
            assert json.loads(body)["error"]["code"].startswith("bad_http"), body
        clean(status, body, [key, tenant] if status >= 400 else [], logged_errors(caplog.records))


# -- HTTP framing --------------------------------------------------------------------------------


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(a raw request whose framing breaks HTTP/1.1, a distinctive token it carries)."""
    token = b"tok" + secrets.token_hex(12).encode()
    bad = draw(st.sampled_from([b"\r", b"\n", b"\x00", b"\r\n ", b"\r\n\t", b"\x7f", b"\x1b"]))
    at = draw(st.integers(0, 20))
    value = b"Bearer " + token[:at] + bad + token[at:]
    kind = draw(st.sampled_from(["value", "no-colon", "long", "method", "version", "length",
                                  "chunked", "both", "name", "target"]))  # fmt: skip
    headers: list[bytes] = [b"Authorization: " + value]
    start = b"POST /v1/chat/completions HTTP/1.1"
    body = b"{}"
    extra: list[bytes] = []
    if kind == "no-colon":
        headers = [b"Authorization Bearer " + token]
    elif kind == "long":
        headers = [b"Authorization: Bearer " + token + b"A" * draw(st.integers(9000, 70000))]
    elif kind == "method":
        start = (
            draw(st.sampled_from([b"G\x00T", b"P@ST", b"\x16\x03\x01", b"GET GET"]))
            + b" /v1/models "
            + token
            + b" HTTP/1.1"
        )
        headers = []
    elif kind == "version":
        start = b"POST /v1/chat/completions HTTP/" + draw(
            st.sampled_from([b"9.9", b"1.x", b"", token])
        )
    elif kind == "length":
        extra = [
            b"Content-Length: "
            + draw(st.sampled_from([b"-1", b"abc", b"1, 2", token, b"99999999999999999999"]))
        ]
    elif kind == "chunked":
        extra = [b"Transfer-Encoding: chunked"]
        body = draw(
            st.sampled_from(
                [b"zz\r\n" + token + b"\r\n0\r\n\r\n", b"5\r\n" + token + b"\r\n", b"-1\r\n\r\n"]
            )
        )
    elif kind == "both":
        extra = [b"Content-Length: 2", b"Transfer-Encoding: chunked"]
    elif kind == "name":
        headers = [b"Auth\x01orization: Bearer " + token, b"X Y: " + token]
    elif kind == "target":
        start = b"POST /v1/chat/completions\x00" + token + b" HTTP/1.1"
    lines = [start, b"Host: gw", b"Connection: close", *headers, *extra]
    if not any(e.startswith((b"Content-Length", b"Transfer")) for e in extra):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body, token


@SETTINGS
@given(request=hostile_requests())
def test_hostile_framing_gets_an_openai_error_and_echoes_nothing(
    server: ServerThread, request: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    raw, token = request
    caplog.clear()
    status, body = send(server.url, raw)
    assert 400 <= status < 500, (raw[:200], status, body[:300])
    clean(status, body, [token], logged_errors(caplog.records))


def test_after_the_storm_it_still_serves_and_counted_what_it_refused(server: ServerThread) -> None:
    status, body = send(server.url, b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX: a\rb\r\n\r\n")
    assert status == 400 and json.loads(body)["error"]["code"].startswith("bad_http")
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'tokenpools_http_refused_total{code="bad_http_request"}' in metrics
    still_serves(server)


def test_refusals_are_logged_at_most_once_per_interval_and_all_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tokenpools.gateway.http_layer import LOG_EVERY_S, HttpLayerRefusals

    now = [0.0]
    refusals = HttpLayerRefusals(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tokenpools.gateway"):
        for i in range(1000):  # a flood: one a millisecond
            now[0] = i / 1000
            refusals.refused("bad_http_request", "203.0.113.9")
        now[0] += LOG_EVERY_S
        refusals.refused("bad_http_method", "203.0.113.9")
    lines = [r for r in caplog.records if "HTTP parser" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.WARNING and not r.exc_info for r in lines)
    assert "and 999 more" in lines[1].getMessage()
    assert refusals.counts == {"bad_http_request": 1000, "bad_http_method": 1}
