"""Bearer JWTs against a real JWKS server on loopback (keys generated here, rotated during a
test): every refusal is a 401 naming its problem; `alg: none` and an HS256 token signed with
the public key are refused; a storm of unknown kids fetches the JWKS at most once per interval;
a JWKS server that hangs does not hold up tokens whose keys are cached."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests.gateway_setup import FAST
from tests.servers import ServerThread, wait_until
from tests.test_tenants import CHAT, CODER, tenants_config
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import ConfigError, parse_config

ISSUER, AUDIENCE = "https://idp.example.test", "tokenpools"


class Idp:
    """An identity provider's JWKS endpoint, and the tokens it would sign."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}
        self.served: list[str] = []  # the kids the endpoint publishes
        self.hits = 0
        self.hang: asyncio.Event | None = None  # set: the endpoint waits on it before answering
        app = web.Application()
        app.router.add_get("/jwks.json", self._jwks)
        self.server = ServerThread(app)

    def new_key(self, kid: str, kind: str = "rsa") -> None:
        if kind == "rsa":
            self.keys[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        else:
            self.keys[kid] = ec.generate_private_key(ec.SECP256R1())
        self.served.append(kid)

    async def _jwks(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.hang is not None:
            await self.hang.wait()
        keys = []
        for kid in self.served:
            key = self.keys[kid]
            alg = "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"
            jwk = json.loads(jwt.get_algorithm_by_name(alg).to_jwk(key.public_key()))
            keys.append({**jwk, "kid": kid, "use": "sig", "alg": alg})
        return web.json_response({"keys": keys})

    def token(
        self, kid: str, tenant: str = "acme", signer: str | None = None, **claims: Any
    ) -> str:
        key = self.keys[signer or kid]
        alg = "RS256" if isinstance(key, rsa.RSAPrivateKey) else "ES256"
        now = int(time.time())
        payload = {"iss": ISSUER, "aud": AUDIENCE, "sub": "svc-1", "tenant": tenant,
                   "iat": now, "exp": now + 300, **claims}  # fmt: skip
        return jwt.encode(payload, key, algorithm=alg, headers={"kid": kid})

    def public_pem(self, kid: str) -> bytes:
        pem: bytes = (
            self.keys[kid]
            .public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return pem


@pytest.fixture
def idp() -> Iterator[Idp]:
    provider = Idp()
    provider.new_key("k1")
    provider.new_key("e1", "ec")
    yield provider
    if provider.hang is not None:
        provider.server.call(provider.hang.set)
    provider.server.stop()


@pytest.fixture
def backend() -> Iterator[ServerThread]:
    server = ServerThread(make_emulator(FAST, speed=1.0))
    yield server
    server.stop()


class Clock:
    """The gateway's clock: real time plus what a test skips ahead."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


def jwt_gateway(backend: ServerThread, idp: Idp, clock: Clock, **jwt_settings: Any) -> ServerThread:
    settings = {"issuer": ISSUER, "audience": AUDIENCE, "jwksUrl": f"{idp.server.url}/jwks.json",
                "modelsClaim": "models", "refreshMinIntervalS": 30, "cacheTtlS": 600,
                **jwt_settings}  # fmt: skip
    data = tenants_config(backend.url, jwt=settings)
    return ServerThread(make_app(Gateway(parse_config(data), clock=clock)))


def chat(server: ServerThread, token: str, model: str = CHAT) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def refusal(response: httpx.Response) -> str:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_token" and error["type"] == "invalid_request_error"
    message: str = error["message"]
    return message


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hs256_with_public_key(idp: Idp, kid: str) -> str:
    """The classic confusion attack: an HMAC whose secret is the RSA public key."""
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    payload = b64(json.dumps({"iss": ISSUER, "aud": AUDIENCE, "tenant": "acme",
                              "exp": int(time.time()) + 300}).encode())  # fmt: skip
    mac = hmac.new(idp.public_pem(kid), f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{b64(mac)}"


def test_every_bad_token_is_a_401_naming_its_problem(backend: ServerThread, idp: Idp) -> None:
    clock = Clock()
    server = jwt_gateway(backend, idp, clock)
    try:
        good = chat(server, idp.token("k1"))
        assert good.status_code == 200 and good.headers["x-tokenpools-entitlement"] == "acme-gold"
        assert chat(server, idp.token("e1"), CODER).status_code == 200  # ES256 too
        now = int(time.time())
        idp.new_key("stranger")
        idp.served.remove("stranger")  # a key the provider never published
        unsigned = jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "tenant": "acme",
                               "exp": now + 300}, None, algorithm="none")  # fmt: skip
        cases = {
            "token expired": idp.token("k1", exp=now - 120),  # past the 30 s leeway
            "not yet valid": idp.token("k1", nbf=now + 120),
            "wrong token issuer": idp.token("k1", iss="https://evil.example.test"),
            "wrong token audience": idp.token("k1", aud="someone-else"),
            "bad token signature": idp.token("k1", signer="stranger"),
            "unknown token key id": idp.token("stranger"),
            "malformed token": "eyJhbGciOi.x.y",
            "algorithm 'none' is not allowed": unsigned,
            "algorithm 'HS256' is not allowed": hs256_with_public_key(idp, "k1"),
            "'exp' claim that is a finite number": idp.token("k1", exp=None),
            "no 'tenant' claim": idp.token("k1", tenant=None),
        }
        for problem, token in cases.items():
            assert problem in refusal(chat(server, token)), problem
        within_leeway = idp.token("k1", exp=now - 5)
        assert chat(server, within_leeway).status_code == 200
        unknown = chat(server, idp.token("k1", tenant="nobody"))
        assert unknown.status_code == 403 and unknown.json()["error"]["code"] == "unknown_tenant"
        narrowed = idp.token("k1", models=[CODER])
        assert chat(server, narrowed, CODER).status_code == 200
        assert chat(server, narrowed, CHAT).status_code == 404
        models = httpx.get(
            f"{server.url}/v1/models", headers={"Authorization": f"Bearer {narrowed}"}
        )
        assert [m["id"] for m in models.json()["data"]] == [CODER]
        text = httpx.get(f"{server.url}/metrics").text
        assert 'tokenpools_unauthorized_total{reason="invalid_token"} 11.0' in text
        assert 'credential="jwt",tenant="acme"' in text
    finally:
        server.stop()


def test_rotated_keys_are_fetched_and_a_kid_storm_fetches_at_most_once_per_interval(
    backend: ServerThread, idp: Idp
) -> None:
    clock = Clock()
    server = jwt_gateway(backend, idp, clock)
    try:
        assert chat(server, idp.token("k1")).status_code == 200
        assert idp.hits == 1
        # the provider rotates: k2 published, k1 withdrawn
        idp.new_key("k2")
        idp.served.remove("k1")
        clock.ahead += 31  # past refreshMinIntervalS: an unknown kid may fetch
        assert chat(server, idp.token("k2")).status_code == 200
        assert idp.hits == 2
        # forged kids, many at once, all inside one interval: no fetch at all
        signed = idp.token("k2")
        forged = [
            b64(json.dumps({"alg": "RS256", "kid": f"forged-{i}"}).encode())
            + signed[signed.index(".") :]
            for i in range(20)
        ]

        async def storm() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as http:
                answers = await asyncio.gather(*(
                    http.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {t}"})
                    for t in forged
                ))  # fmt: skip
            return [a.status_code for a in answers]

        assert asyncio.run(storm()) == [401] * 20
        assert idp.hits == 2
        for token in forged[:3]:
            assert "unknown token key id" in refusal(chat(server, token))
        assert idp.hits == 2
        # k1 is no longer published: after the refetch it is refused
        assert "unknown token key id" in refusal(chat(server, idp.token("k1")))
    finally:
        server.stop()


def test_a_hanging_jwks_server_does_not_hold_up_tokens_whose_keys_are_cached(
    backend: ServerThread, idp: Idp
) -> None:
    clock = Clock()
    server = jwt_gateway(backend, idp, clock, cacheTtlS=60)
    try:
        assert chat(server, idp.token("k1")).status_code == 200
        idp.hang = idp.server.call(asyncio.Event)  # the provider stops answering
        clock.ahead += 120  # the cached keys are stale: refetched in the background
        for _ in range(3):
            assert chat(server, idp.token("k1")).status_code == 200
        wait_until(lambda: idp.hits == 2)  # the refetch is on its way, still unanswered
        assert not idp.hang.is_set()
        assert chat(server, idp.token("e1"), CODER).status_code == 200
    finally:
        idp.server.call(idp.hang.set)  # so the gateway's fetch ends before the gateway does
        server.stop()


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"algorithms": ["HS256"]}, "algorithm 'HS256' is not allowed"),
        ({"algorithms": ["none"]}, "algorithm 'none' is not allowed"),
        ({"jwksUrl": None}, "give jwksUrl or jwksFile"),
        ({"jwksFile": "/etc/jwks.json"}, "give jwksUrl or jwksFile"),
        ({"leewayS": 3600}, "leewayS"),
    ],
)
def test_unsafe_jwt_settings_are_refused(settings: dict[str, Any], problem: str) -> None:
    jwt_settings = {"issuer": ISSUER, "audience": AUDIENCE, "jwksUrl": "http://127.0.0.1:1/j"}
    jwt_settings = {k: v for k, v in (jwt_settings | settings).items() if v is not None}
    with pytest.raises(ConfigError) as refused:
        parse_config(tenants_config("http://127.0.0.1:1", jwt=jwt_settings))
    assert problem in str(refused.value)
