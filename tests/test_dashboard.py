"""The dashboard's data: the history ring buffers (bounded, rates from the decisions counted),
`/admin/history` behind the admin key, the page's files, and `tokenpools top`."""

from __future__ import annotations

from typing import Any

import httpx
from typer.testing import CliRunner

from tests.builders import make_config
from tests.gateway_setup import KEYS, admin, client, gateway  # noqa: F401  (fixture)
from tests.servers import ServerThread, wait_until
from tests.test_admission import GUARANTEED, SMALL, SPOT
from tokenpools.admission.access_log import RequestRecord
from tokenpools.cli import app
from tokenpools.control.core import DecisionCore
from tokenpools.control.snapshot import snapshot
from tokenpools.gateway.history import History
from tokenpools.model.request import Usage
from tokenpools.state.memory import MemoryStore


def test_history_keeps_a_bounded_number_of_samples_with_rates_since_the_last() -> None:
    core = DecisionCore(make_config([GUARANTEED, SPOT]), MemoryStore())
    history = History("r0", length=10, refusals=3)
    t = 0.0
    for period in range(50):
        t = 5.0 * period
        for _ in range(4):  # gold: 4 admitted per period, released at once
            d = core.admit("gold", SMALL, t)
            history.decided("gold", d, t)
            assert d.admitted
            core.settle(d.lease.lease_id, Usage(64, 64), t)  # type: ignore[union-attr]
        record = RequestRecord("r", "POST", "/v1/chat/completions", started=0.0)
        record.entitlement, record.ttft_s = "gold", 0.1 * (period % 3 + 1)
        history.finished(record)
        core.tick(t)
        history.sample(snapshot(core, t))
    assert len(history.samples) == 10  # the ring buffer's length, whatever the periods
    last = history.samples[-1]
    gold = last["entitlements"]["gold"]
    assert gold["admitted_per_s"] == 4 / 5.0 and gold["admitted_total"] == 200
    assert gold["refused_per_s"] == {} and gold["ttft_p50_s"] == 0.2
    assert last["pools"]["p"]["capacity"]["concurrency"] == 16
    assert last["pools"]["p"]["tokens_per_s_used"] == 4 * 128 / 5.0  # settled in the period
    # Refusals: counted per reason, the last ones kept (at most `refusals`).
    spot = [core.admit("spot", SMALL, t + 1) for _ in range(16)]
    for d in spot:
        history.decided("spot", d, t + 1)
    refused = [d for d in spot if not d.admitted]
    assert refused and len(history.refusals) == 3
    history.sample(snapshot(core, t + 2))
    rates = history.samples[-1]["entitlements"]["spot"]["refused_per_s"]
    assert rates == {"pool_full": len(refused) / 2.0}
    assert history.refusals[-1]["reason"] == "pool_full"
    assert history.refusals[-1]["retry_after_s"] is not None


def test_admin_history_needs_the_admin_key_and_says_what_it_shows(
    gateway: ServerThread,  # noqa: F811
) -> None:
    assert httpx.get(f"{gateway.url}/admin/history").status_code == 401
    wrong = httpx.get(f"{gateway.url}/admin/history", headers={"Authorization": "Bearer sk-x"})
    assert wrong.status_code == 401 and "samples" not in wrong.text
    client(gateway).chat.completions.create(
        model="qwen3-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    wait_until(lambda: admin(gateway, "history")["samples"])  # the first tick takes one
    body: dict[str, Any] = admin(gateway, "history")
    assert body["replica"] and body["store"] == {"backend": "memory", "up": True}
    assert body["update_period_s"] == 5.0
    assert [b["healthy"] for b in body["backends"]["pool"]] == [True]
    assert set(body["samples"][0]["entitlements"]) == {"gold", "spot", "batch"}


def test_the_page_is_served_without_a_key_and_nothing_else_is() -> None:
    from tests.gateway_setup import config_data
    from tokenpools.gateway.app import Gateway, make_app
    from tokenpools.model.config import parse_config

    server = ServerThread(make_app(Gateway(parse_config(config_data("http://127.0.0.1:9")))))
    try:
        page = httpx.get(f"{server.url}/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "Admin key" in page.text
        for path in ("dashboard.js", "dashboard.css", "vendor/uPlot.iife.min.js"):
            assert httpx.get(f"{server.url}/dashboard/{path}").status_code == 200
        for path in ("../runtime.py", "vendor/uPlot.LICENSE", "nope.js", "%2e%2e/app.py"):
            r = httpx.get(f"{server.url}/dashboard/{path}")
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "not_found"
    finally:
        server.stop()


def test_top_prints_the_pools_and_entitlements_once(gateway: ServerThread) -> None:  # noqa: F811
    wait_until(lambda: admin(gateway, "history")["samples"])
    cli = CliRunner().invoke(
        app, ["top", "--url", gateway.url, "--admin-key", KEYS["admin"], "--once"]
    )
    assert cli.exit_code == 0, cli.output
    for name in ("pool", "gold", "spot", "batch", "guaranteed", "preemptible", "tenant"):
        assert name in cli.output
    bad = CliRunner().invoke(app, ["top", "--url", gateway.url, "--admin-key", "sk-x", "--once"])
    assert bad.exit_code == 1 and "admin key" in bad.output
