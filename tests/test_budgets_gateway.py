"""Budgets through the gateway and the official openai client, on an injected clock: admitted
answers say the budget left and when it resets (the configured zone's midnight); the request
that does not fit is a 429 `insufficient_quota` naming the budget, with Retry-After until that
reset; a new day admits again. The ledger (`/admin/usage`, JSON and CSV, and `tokenpools
usage`), `/admin/budgets`, `/metrics`, and the signed webhook notices (once per threshold and
window, retried after a failure) all report the same usage."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import openai
import pytest
from aiohttp import web
from typer.testing import CliRunner

from tests.gateway_setup import FAST
from tests.servers import ServerThread, wait_until
from tokenpools.cli import app as cli
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key

NY = ZoneInfo("America/New_York")
START = datetime(2026, 12, 1, 20, 0, tzinfo=NY).timestamp()  # 4 hours before NY's midnight
MIDNIGHT = datetime(2026, 12, 2, 0, 0, tzinfo=NY).timestamp()
ADMIN = {"Authorization": "Bearer sk-admin"}
LIMIT = 600


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def webhook() -> Iterator[tuple[ServerThread, list[tuple[dict[str, str], bytes]]]]:
    """A receiver that fails its first POST (the notice is retried) and keeps the rest."""
    got: list[tuple[dict[str, str], bytes]] = []
    calls = [0]

    async def receive(request: web.Request) -> web.Response:
        calls[0] += 1
        if calls[0] == 1:
            return web.Response(status=500)
        got.append((dict(request.headers), await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", receive)
    server = ServerThread(app)
    yield server, got
    server.stop()


@pytest.fixture
def setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, webhook: Any
) -> Iterator[tuple[ServerThread, Gateway, Clock, str]]:
    backend = ServerThread(make_emulator(FAST, speed=1.0))
    monkeypatch.setenv("HOOK_SECRET", "s3cret")
    database = f"sqlite:///{tmp_path / 'usage.sqlite3'}"
    config = parse_config({
        "gateway": {"adminKeys": [hash_key("sk-admin")]},
        "usage": {"timeZone": "America/New_York", "database": database, "flushIntervalS": 1,
                  "webhook": {"url": f"{webhook[0].url}/hook", "secretEnv": "HOOK_SECRET"}},
        "pools": [{"name": "p", "model": "Qwen3-8B", "servedModels": ["m"],
                   "prices": {"inputPerMillion": "2.50", "outputPerMillion": 10},
                   "backends": [{"url": backend.url, "timeoutS": 30}],
                   "perReplica": {"tokensPerSecond": 1e6, "kvTokens": 1e6, "concurrency": 16}}],
        "entitlements": [
            {"name": "acme-e", "tenantId": "acme", "pool": "p", "serviceClass": "elastic",
             "concurrency": 8},
            {"name": "bolt-e", "tenantId": "bolt", "pool": "p", "serviceClass": "elastic"},
        ],
        "tenants": [{"id": "acme", "keys": [{"hash": hash_key("sk-acme"), "label": "app"}]},
                    {"id": "bolt", "keys": [{"hash": hash_key("sk-bolt"), "label": "app"}]}],
        "budgets": [{"name": "acme-day", "tenant": "acme", "limit": LIMIT, "window": "day",
                     "notifyAt": [0.5, 1.0]}],
    })  # fmt: skip
    clock = Clock()
    gw = Gateway(config, clock=clock)
    gw.notices.notifier._sleep = _no_wait
    server = ServerThread(make_app(gw))
    yield server, gw, clock, database
    server.stop()
    backend.stop()


async def _no_wait(seconds: float) -> None:
    del seconds


def ask(server: ServerThread, key: str) -> Any:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    return client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=100
    )


def test_a_budget_through_the_gateway_its_ledger_and_its_notices(setup: Any, webhook: Any) -> None:
    server, gw, clock, database = setup
    used = 0
    raw = ask(server, "sk-acme")
    usage = raw.parse().usage
    assert raw.headers["x-tokenpools-budget"] == "acme-day"
    assert raw.headers["x-tokenpools-budget-reset"] == "2026-12-02T05:00:00Z"  # NY midnight
    remaining = int(raw.headers["x-tokenpools-budget-remaining"])
    assert LIMIT - remaining == usage.prompt_tokens + 100  # the worst case, held while it ran
    used += usage.prompt_tokens + usage.completion_tokens
    admitted = 1
    while True:
        try:
            usage = ask(server, "sk-acme").parse().usage
        except openai.RateLimitError as exc:
            refusal = exc
            break
        used += usage.prompt_tokens + usage.completion_tokens
        admitted += 1
    assert refusal.code == "insufficient_quota" and refusal.type == "insufficient_quota"
    assert "budget 'acme-day'" in refusal.message
    assert refusal.response.headers["x-tokenpools-budget"] == "acme-day"
    assert int(refusal.response.headers["retry-after"]) == MIDNIGHT - START
    assert ask(server, "sk-bolt").parse().usage  # another tenant is unaffected
    (status,) = httpx.get(f"{server.url}/admin/budgets", headers=ADMIN).json()["budgets"]
    assert status["used"] == used and status["held"] == 0 and used <= LIMIT

    # notices: the flush interval passes; each threshold once, signed, the first retried
    clock.now += 2
    server.call(gw.notices.check)
    hooks = webhook[1]
    wait_until(lambda: len(hooks) == 2)
    clock.now += 2
    server.call(gw.notices.check)  # nothing new: once per threshold and window
    thresholds = sorted(json.loads(body)["threshold"] for _, body in hooks)
    assert thresholds == [0.5, 1.0] and len(hooks) == 2
    for headers, body in hooks:
        signed = headers["x-tokenpools-timestamp"].encode() + b"." + body
        expected = hmac.new(b"s3cret", signed, hashlib.sha256).hexdigest()
        assert headers["x-tokenpools-signature"] == f"sha256={expected}"

    # the ledger: requests, tokens, cost and the refusal, per tenant and key
    query = {"by": "tenant,key", "per": "all", "from": "2026-12-01"}
    rows = httpx.get(f"{server.url}/admin/usage", params=query, headers=ADMIN).json()["rows"]
    acme = next(r for r in rows if r["tenant"] == "acme")
    assert (acme["key"], acme["requests"]) == ("app", admitted)
    assert acme["input_tokens"] + acme["output_tokens"] == used
    cost = -(-(acme["input_tokens"] * 2_500_000 + acme["output_tokens"] * 10_000_000) // 10**6)
    assert abs(acme["cost_micros"] - cost) <= admitted  # rounded up per request
    assert acme["refusals"] == {"budget": 1}
    csv = httpx.get(
        f"{server.url}/admin/usage", params={"format": "csv", "per": "day"}, headers=ADMIN
    )
    assert csv.text.splitlines()[0].startswith("period,tenant,requests,")
    assert "2026-12-01,acme," in csv.text
    bad = httpx.get(f"{server.url}/admin/usage", params={"per": "decade"}, headers=ADMIN)
    assert bad.status_code == 400 and "per: 'decade'" in bad.json()["error"]["message"]
    assert httpx.get(f"{server.url}/admin/usage").status_code == 401

    metrics = httpx.get(f"{server.url}/metrics").text
    assert (
        f'tokenpools_budget_used{{budget="acme-day",measure="tokens",window="day"}} {float(used)}'
        in metrics
    )
    assert "tokenpools_cost_micros_total{" in metrics

    out = CliRunner().invoke(cli, ["usage", "--database", database, "--per", "all", "--csv",
                                   "--from", "2026-12-01"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert f"acme,{admitted}," in out.output

    clock.now = MIDNIGHT + 1  # a new day in New York: the budget is whole again
    assert int(ask(server, "sk-acme").headers["x-tokenpools-budget-remaining"]) > LIMIT - 200
