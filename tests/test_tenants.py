"""Tenants through the official openai client: one key reaches every model of its tenant in
two pools, each request charged to the right entitlement; a key's model allow-list; layered
entitlements (guaranteed, then spot); key expiry, rotation and revocation by a reload; the
trusted header of an auth proxy, honoured from its address only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_setup import FAST, wait_all_ended
from tests.servers import ServerThread, wait_until
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key

CHAT, FAST_CHAT, CODER = "qwen3-8b", "qwen3-8b-fast", "coder"
ADMIN = "sk-admin"
REPLICA = {"tokensPerSecond": 100000, "kvTokens": 65536, "concurrency": 8}


def tenants_config(backend: str, **gateway: Any) -> dict[str, Any]:
    def pool(name: str, models: list[str]) -> dict[str, Any]:
        return {"name": name, "model": "Qwen3-8B", "servedModels": models,
                "backends": [{"url": backend, "timeoutS": 30}], "perReplica": REPLICA}  # fmt: skip

    def ent(name: str, tenant: str, pool: str, cls: str, **more: Any) -> dict[str, Any]:
        return {"name": name, "tenantId": tenant, "pool": pool, "serviceClass": cls, **more}

    return {
        "policy": {"retryAfterMinS": 1},
        "gateway": {"adminKeys": [hash_key(ADMIN)], **gateway},
        "pools": [pool("chat", [CHAT, FAST_CHAT]), pool("code", [CODER])],
        "entitlements": [
            ent("acme-gold", "acme", "chat", "guaranteed", concurrency=2),
            ent("acme-spot", "acme", "chat", "spot"),
            ent("acme-code", "acme", "code", "elastic", concurrency=2),
            ent("other-chat", "other", "chat", "elastic", concurrency=1),
        ],
        "tenants": [
            {"id": "acme", "keys": [
                {"hash": hash_key("sk-acme"), "label": "laptop"},
                {"hash": hash_key("sk-acme-ci"), "label": "ci", "models": [CODER]},
                {"hash": hash_key("sk-acme-old"), "label": "old", "expiresAt": "2020-01-01T00:00Z"},
            ]},
            {"id": "other", "keys": [{"hash": hash_key("sk-other")}]},
        ],
    }  # fmt: skip


@pytest.fixture
def backend() -> Iterator[ServerThread]:
    server = ServerThread(make_emulator(FAST, speed=1.0))
    yield server
    server.stop()


@pytest.fixture
def gateway(backend: ServerThread) -> Iterator[ServerThread]:
    server = ServerThread(make_app(Gateway(parse_config(tenants_config(backend.url)))))
    yield server
    wait_all_ended(server, ADMIN)
    server.stop()


def entitlements(server: ServerThread) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/admin/entitlements", headers={"Authorization": f"Bearer {ADMIN}"})
    data: dict[str, Any] = r.json()
    return data


def client(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def charged(server: ServerThread, key: str, model: str) -> str:
    """The entitlement a request of `key` for `model` is charged to (the gateway's header)."""
    raw = client(server, key).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.parse().usage is not None
    return raw.headers["x-tokenpools-entitlement"]


def admitted(server: ServerThread) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tokenpools_admitted_total{"):
            name = line.split('entitlement="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_one_key_reaches_three_models_in_two_pools_each_charged_to_its_entitlement(
    gateway: ServerThread,
) -> None:
    got = [charged(gateway, "sk-acme", m) for m in (CHAT, FAST_CHAT, CODER, CODER)]
    assert got == ["acme-gold", "acme-gold", "acme-code", "acme-code"]
    assert admitted(gateway) == {"acme-gold": 2.0, "acme-code": 2.0}
    assert charged(gateway, "sk-other", CHAT) == "other-chat"
    ids = [m.id for m in client(gateway, "sk-acme").models.list()]
    assert ids == sorted([CHAT, FAST_CHAT, CODER])
    assert [m.id for m in client(gateway, "sk-other").models.list()] == [CHAT, FAST_CHAT]
    with pytest.raises(openai.NotFoundError):  # other has nothing in the code pool
        charged(gateway, "sk-other", CODER)


def test_a_model_outside_the_keys_allow_list_is_not_found_and_not_listed(
    gateway: ServerThread,
) -> None:
    assert charged(gateway, "sk-acme-ci", CODER) == "acme-code"
    with pytest.raises(openai.NotFoundError) as missing:
        charged(gateway, "sk-acme-ci", CHAT)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert [m.id for m in client(gateway, "sk-acme-ci").models.list()] == [CODER]
    with pytest.raises(openai.NotFoundError):
        client(gateway, "sk-acme-ci").models.retrieve(CHAT)


def test_an_expired_or_unknown_key_is_refused_naming_why(gateway: ServerThread) -> None:
    with pytest.raises(openai.AuthenticationError) as expired:
        charged(gateway, "sk-acme-old", CHAT)
    assert expired.value.body["code"] == "expired_api_key"  # type: ignore[index]
    assert "'old'" in expired.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError) as unknown:
        client(gateway, "sk-nobody").models.list()
    assert unknown.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'tokenpools_unauthorized_total{reason="expired_api_key"} 1.0' in metrics


def test_guaranteed_then_spot_then_guaranteed_again(gateway: ServerThread) -> None:
    """acme's baseline is 2 guaranteed slots: a third request goes on spot, and once a slot
    frees the next is guaranteed again; the header says which, every time."""
    acme = client(gateway, "sk-acme")
    held = []
    for _ in range(2):
        raw = acme.chat.completions.with_raw_response.create(
            model=CHAT, messages=[{"role": "user", "content": "go"}], max_tokens=2000, stream=True
        )
        assert raw.headers["x-tokenpools-entitlement"] == "acme-gold"
        assert raw.headers["x-tokenpools-service-class"] == "guaranteed"
        stream = raw.parse()
        next(iter(stream))  # running: it holds its slot
        held.append(stream)
    assert charged(gateway, "sk-acme", CHAT) == "acme-spot"
    assert charged(gateway, "sk-acme", FAST_CHAT) == "acme-spot"
    held.pop().close()
    wait_until(lambda: entitlements(gateway)["acme-gold"]["in_flight"] == 1)
    assert charged(gateway, "sk-acme", CHAT) == "acme-gold"
    held.pop().close()
    assert admitted(gateway) == {"acme-gold": 3.0, "acme-spot": 2.0}


def test_a_key_rotated_with_overlap_then_revoked_by_a_reload(backend: ServerThread) -> None:
    data = tenants_config(backend.url)
    gw = Gateway(parse_config(data))
    server = ServerThread(make_app(gw))
    try:
        acme = data["tenants"][0]["keys"]
        acme.append({"hash": hash_key("sk-acme-new"), "label": "laptop-2"})
        server.call(lambda: gw.reload(parse_config(data)))  # both keys work meanwhile
        assert charged(server, "sk-acme", CHAT) == charged(server, "sk-acme-new", CHAT)
        acme.pop(0)
        server.call(lambda: gw.reload(parse_config(data)))
        with pytest.raises(openai.AuthenticationError):
            charged(server, "sk-acme", CHAT)
        assert charged(server, "sk-acme-new", CHAT) == "acme-gold"
        text = httpx.get(f"{server.url}/metrics").text
        assert 'credential="laptop-2",tenant="acme"} 2.0' in text  # labels, never keys
        assert "sk-acme" not in text
    finally:
        server.stop()


# -- the trusted header of an auth proxy --------------------------------------------------

PROXY = "127.0.0.2"  # the auth proxy's address; the tests' other client comes from 127.0.0.1


def post_chat(server: ServerThread, source: str, headers: dict[str, str]) -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=30) as http:
        return http.post(
            f"{server.url}/v1/chat/completions",
            json={"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers=headers,
        )


@pytest.mark.parametrize("secret", [False, True])
def test_the_trusted_header_is_honoured_from_the_proxy_only(
    backend: ServerThread, secret: bool
) -> None:
    trusted: dict[str, Any] = {"name": "x-tenant", "fromCidrs": [f"{PROXY}/32"]}
    if secret:
        trusted |= {"secretHeader": "x-proxy-secret", "secretHash": hash_key("s3cret")}
    data = tenants_config(backend.url, trustedHeader=trusted)
    server = ServerThread(make_app(Gateway(parse_config(data))))
    try:
        ok = post_chat(server, PROXY, {"x-tenant": "acme"})
        assert ok.status_code == 200 and ok.headers["x-tokenpools-entitlement"] == "acme-gold"
        # from elsewhere the header counts for nothing: the key decides, or a 401 says why
        forged = post_chat(server, "127.0.0.1", {"x-tenant": "acme"})
        assert forged.status_code == 401
        assert "x-tenant is honoured only from the auth proxy" in forged.json()["error"]["message"]
        keyed = post_chat(
            server, "127.0.0.1", {"x-tenant": "acme", "Authorization": "Bearer sk-other"}
        )
        assert keyed.status_code == 200
        assert keyed.headers["x-tokenpools-entitlement"] == "other-chat"
        with_secret = post_chat(
            server, "127.0.0.1", {"x-tenant": "acme", "x-proxy-secret": "s3cret"}
        )
        assert with_secret.status_code == (200 if secret else 401)
        wrong = post_chat(server, "127.0.0.1", {"x-tenant": "acme", "x-proxy-secret": "guess"})
        assert wrong.status_code == 401
        nobody = post_chat(server, PROXY, {"x-tenant": "nobody"})
        assert nobody.status_code == 403 and nobody.json()["error"]["code"] == "unknown_tenant"
    finally:
        server.stop()


def test_the_admin_api_groups_by_tenant_and_never_shows_a_key(gateway: ServerThread) -> None:
    charged(gateway, "sk-acme", CODER)
    r = httpx.get(f"{gateway.url}/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"})
    tenants = r.json()
    assert sorted(tenants) == ["acme", "other"]
    acme = tenants["acme"]
    assert [e["entitlement"] for e in acme["pools"]["chat"]] == ["acme-gold", "acme-spot"]
    assert [e["class"] for e in acme["pools"]["chat"]] == ["guaranteed", "spot"]
    assert [k["label"] for k in acme["keys"]] == ["laptop", "ci", "old"]
    assert acme["keys"][1]["models"] == [CODER]
    assert "sha256" not in r.text
    assert httpx.get(f"{gateway.url}/admin/tenants").status_code == 401
