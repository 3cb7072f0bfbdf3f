"""The validating admission webhook over HTTPS, with AdmissionReview bodies as the API server
sends them: it refuses what the config loader refuses, a pool that does not exist or is not
open to the namespace, and a key hash another entitlement has."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest
import trustme
from aiohttp import web

from tokenpools.k8s.operator_http import webhook_app
from tokenpools.model.keys import hash_key

KEY = hash_key("sk-taken")
OPEN_TO_TENANTS = {"namespaceSelector": {"matchLabels": {"tokenpools.io/tenant": "true"}}}
POOL = {"metadata": {"name": "qwen"}, "spec": OPEN_TO_TENANTS}


class FakeLookup:
    """The cluster as the webhook sees it (the real one is CachedLookup, the API's watches)."""

    def ready(self) -> bool:
        return True

    def pool(self, name: str) -> Mapping[str, Any] | None:
        return POOL if name == "qwen" else None

    def pools(self) -> list[Mapping[str, Any]]:
        return [POOL]

    def key_holders(self, key: str) -> list[tuple[str, str]]:
        return [("team-b", "old")] if key == KEY else []

    def namespace_labels(self, name: str) -> Mapping[str, str]:
        return {"tokenpools.io/tenant": "true"} if name.startswith("team-") else {}

    def entitlements(self) -> list[Mapping[str, Any]]:
        return [{"metadata": {"name": "old", "namespace": "team-b"},
                 "spec": {"apiKeyHashes": [KEY]}}]  # fmt: skip


@pytest.fixture(scope="module")
def webhook() -> Iterator[tuple[str, ssl.SSLContext]]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def start() -> None:
        runner = web.AppRunner(webhook_app(FakeLookup()))
        await runner.setup()
        ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(ssl_ctx)  # the server side of the trustme pair
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_ctx)
        await site.start()
        state["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        state["runner"] = runner
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()),
                              daemon=True)  # fmt: skip
    thread.start()
    assert ready.wait(10)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    yield f"https://127.0.0.1:{state['port']}/validate", client_ctx
    asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def _review(kind: str, ns: str, spec: Any, op: str = "CREATE") -> dict[str, Any]:
    meta = {"name": "x", **({"namespace": ns} if ns else {})}
    obj = {"apiVersion": "tokenpools.io/v1alpha1", "kind": kind, "metadata": meta, "spec": spec}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "42", "kind": {"group": "tokenpools.io", "version": "v1alpha1",
                        "kind": kind}, "namespace": ns, "name": "x", "operation": op,
                        "object": obj}}  # fmt: skip


def _ask(webhook: tuple[str, ssl.SSLContext], body: Any) -> dict[str, Any]:
    url, ca = webhook
    resp = httpx.post(url, json=body, verify=ca)
    assert resp.status_code == 200
    answer = resp.json()["response"]
    assert answer["uid"] == "42"
    return answer  # type: ignore[no-any-return]


GOOD_ENT = {"pool": "qwen", "serviceClass": "guaranteed", "concurrency": 2}
GOOD_POOL = {"model": "Qwen3-8B", "perReplica": {"tokensPerSecond": 240, "concurrency": 8,
                                                 "kvTokens": 16384}}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "ns", "spec", "why"),
    [
        ("TokenEntitlement", "team-a", {**GOOD_ENT, "concurrency": -1}, "concurrency"),
        ("TokenEntitlement", "team-a", {**GOOD_ENT, "tenantId": "team-b"}, "tenantId"),
        ("TokenEntitlement", "team-a", {**GOOD_ENT, "pool": "nope"}, "no TokenPool 'nope'"),
        ("TokenEntitlement", "outsiders", GOOD_ENT, "not open to namespace 'outsiders'"),
        ("TokenEntitlement", "team-a", {**GOOD_ENT, "apiKeyHashes": [KEY]}, "already used"),
        ("TokenPool", "", {**GOOD_POOL, "model": "qwen3-8b"}, "built-in profile"),
        ("TokenPool", "", {**GOOD_POOL, "tokenizer": "/var/run/secrets/token"}, "tokenizer"),
        (
            "TokenPool",
            "",
            {**GOOD_POOL, "backends": [{"url": "http://x", "apiKeyFile": "/etc/shadow"}]},
            "apiKeyFile",
        ),
        ("TokenPool", "", {**GOOD_POOL, "replicas": 5, "maxReplicas": 2}, "maxReplicas"),
    ],
)
def test_the_webhook_refuses_what_the_loader_refuses(
    webhook: tuple[str, ssl.SSLContext], kind: str, ns: str, spec: Any, why: str
) -> None:
    answer = _ask(webhook, _review(kind, ns, spec))
    assert answer["allowed"] is False and answer["status"]["code"] == 422
    assert why in answer["status"]["message"], answer["status"]["message"]


def test_the_webhook_admits_valid_objects_and_deletes(webhook: tuple[str, ssl.SSLContext]) -> None:
    assert _ask(webhook, _review("TokenEntitlement", "team-a", GOOD_ENT))["allowed"] is True
    assert _ask(webhook, _review("TokenPool", "", GOOD_POOL))["allowed"] is True
    bad = _review("TokenEntitlement", "team-a", {"pool": "nope"}, op="DELETE")
    assert _ask(webhook, bad)["allowed"] is True


def test_the_webhook_answers_bad_bodies_with_400(webhook: tuple[str, ssl.SSLContext]) -> None:
    url, ca = webhook
    assert httpx.post(url, content=b"{not json", verify=ca).status_code == 400
    assert httpx.post(url, json=[1, 2], verify=ca).status_code == 400
    odd = _ask(webhook, _review("TokenEntitlement", "team-a", "a string"))
    assert odd["allowed"] is False and "spec" in odd["status"]["message"]
