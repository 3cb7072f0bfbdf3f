"""The dashboard end to end, in a real headless Chromium (Debian's `chromium`, which .ci/run
installs; Playwright drives it through `executable_path`): the gateway in front of the
emulator under load from `tokenpools load`; the page, given the admin key, shows the pool
and every entitlement, spot's refusal counter rises, and the charts have drawn points; a
wrong key shows no data. The screenshot docs/dashboard.md uses is taken here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from playwright.sync_api import Page, expect, sync_playwright

from tests.gateway_setup import FAST, KEYS, config_data
from tests.servers import ServerThread, wait_until
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "dashboard.png"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TENANT = {"prompt": {"kind": "fixed", "value": 64}, "output": {"kind": "fixed", "value": 48}}


def load_scenario(path: Path, seconds: float) -> Path:
    """gold at its baseline, spot flooding the pool (so it is refused), batch filling in."""
    scenario = {
        "name": "dashboard-load",
        "description": "a small load for the dashboard test",
        "duration_s": seconds,
        "seed": 1,
        "engine": {"profile": "paper-dgx-spark-qwen3-8b", "replicas": 1},
        "tokenpools": config_data("http://unused"),
        "phases": [{"name": "all", "start_s": 0, "end_s": seconds}],
        "tenants": [
            {"name": "gold", "workload": {"arrivals": {"kind": "poisson", "slots": 3}, **TENANT}},
            {"name": "spot", "workload": {"arrivals": {"kind": "poisson", "slots": 40}, **TENANT}},
            {"name": "batch", "workload": {"arrivals": {"kind": "poisson", "slots": 4}, **TENANT}},
        ],
    }
    path.write_text(yaml.safe_dump(scenario))
    return path


@pytest.fixture
def served() -> Iterator[ServerThread]:
    emulator = ServerThread(make_emulator(FAST, speed=1.0))
    data = config_data(emulator.url, updatePeriodS=0.5)
    tenant = next(e["tenantId"] for e in data["entitlements"] if e["name"] == "batch")
    data["budgets"] = [{"name": "batch-month", "tenant": tenant, "limit": 200_000}]
    gw = Gateway(parse_config(data))
    gateway = ServerThread(make_app(gw, health_interval_s=0.2))
    yield gateway
    gateway.stop()
    emulator.stop()


def refused(page: Page, entitlement: str) -> int:
    cell = page.locator(f'tr[data-entitlement="{entitlement}"] td[data-column="refused"]')
    return int(cell.inner_text())


def test_the_dashboard_shows_the_pool_live_and_nothing_without_the_key(
    served: ServerThread, tmp_path: Path
) -> None:
    scenario = load_scenario(tmp_path / "load.yaml", seconds=12.0)
    keys = [f"--key={name}={KEYS[name]}" for name in ("gold", "spot", "batch")]
    load = subprocess.Popen(
        [sys.executable, "-m", "tokenpools.cli", "load", str(scenario), "--target", served.url,
         "--json", str(tmp_path / "load.json"), *keys],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1500, "height": 1300})
            page.goto(f"{served.url}/dashboard")
            # A wrong key: refused, and no data on the page.
            page.fill("#key", "sk-wrong")
            page.click("button[type=submit]")
            expect(page.locator("#login-error")).to_contain_text("refused")
            expect(page.locator("#board")).to_be_hidden()
            assert page.locator("#entitlements tbody tr").count() == 0
            assert page.locator("#pools .pool").count() == 0
            # The admin key: the pool and every entitlement.
            page.fill("#key", KEYS["admin"])
            page.click("button[type=submit]")
            expect(page.locator("#pool-card-pool")).to_contain_text("backends")
            for name in ("gold", "spot", "batch"):
                expect(page.locator(f'tr[data-entitlement="{name}"]')).to_be_visible()
            # spot is refused while it floods, and the counter rises from one poll to the next
            wait_until(lambda: refused(page, "spot") > 0, 20)
            first = refused(page, "spot")
            wait_until(lambda: refused(page, "spot") > first, 20)
            points = "() => window.tokenpools.charts.priority.data[0].length"
            wait_until(lambda: page.evaluate(points) >= 3, 20)
            drawn = "() => window.tokenpools.charts['pool-pool'].data[1].filter(v => v > 0).length"
            assert page.evaluate(drawn) > 0  # slots in flight were drawn
            settled = "() => window.tokenpools.charts['tps-pool'].data[1].filter(v => v > 0).length"
            wait_until(lambda: page.evaluate(settled) > 0, 20)  # tokens/s settled were drawn
            # batch's budget: a bar that fills as it is charged, and the hourly usage chart
            budget = page.locator('#budgets tr[data-budget="batch-month"]')
            expect(budget).to_contain_text("month, tokens")
            used = budget.locator('td[data-column="used"] .used')
            wait_until(lambda: used.evaluate("e => parseFloat(e.style.width)") > 0, 20)
            usage = (
                "() => (window.tokenpools.charts.usage?.data[1] || []).filter(v => v > 0).length"
            )
            wait_until(lambda: page.evaluate(usage) > 0, 30)
            # The table sorts by a column header: priority, highest first, then lowest first.
            first_row = page.locator("#entitlements tbody tr").first
            page.click('#entitlements th:text-is("priority")')
            expect(first_row).to_have_attribute("data-entitlement", "gold")
            page.click('#entitlements th:text-is("priority")')
            expect(first_row).to_have_attribute("data-entitlement", "batch")
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            # Forgetting the key hides everything again.
            page.click("#logout")
            expect(page.locator("#board")).to_be_hidden()
            assert page.locator("#entitlements tbody tr").count() == 0
            browser.close()
    finally:
        _, err = load.communicate(timeout=60)
    assert load.returncode == 0, err.decode()
    assert SCREENSHOT.stat().st_size > 20_000
