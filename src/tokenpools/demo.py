"""`tokenpools demo`: paper experiment 1 over real HTTP, with and without tokenpools.

Two emulated backends, each its own process, run the paper's engine profile in real time. The
scenario's tenants send the same load to both at once: through the gateway (which holds the
scenario's entitlements, guaranteed-c's created when it joins and expired when it leaves) to
the first, and straight to the second — no admission control. Then the comparison table,
figures and JSON.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tokenpools.engine.profile import load_profile
from tokenpools.gateway.app import make_app as make_gateway
from tokenpools.gateway.http_layer import GatewayRunner
from tokenpools.gateway.runtime import Gateway
from tokenpools.loadgen import LoadRun, Target
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key
from tokenpools.processes import spawn_server, stop
from tokenpools.sim.experiments import write_figures
from tokenpools.sim.metrics import summarize
from tokenpools.sim.records import RunResult
from tokenpools.sim.report import policy_table
from tokenpools.sim.scenario import Scenario

ADMIN_KEY = "sk-demo-admin"
MODEL = "demo-model"


@dataclass(frozen=True, slots=True)
class TakenBack:
    """What taking back did behind the gateway, from its metrics at the end of the run:
    requests taken back (`tokenpools_evicted_total`), the suspensions among them (resumed, or
    ended at their deadline), the prompt tokens resumptions prefilled again, and how long a
    suspended request waited for room in all (P50, P99: interpolated within the histogram's
    buckets, as Prometheus' histogram_quantile does; None with nothing suspended)."""

    taken_back: int = 0
    suspensions: int = 0
    recomputed_prompt_tokens: int = 0
    suspended_p50_s: float | None = None
    suspended_p99_s: float | None = None

    @classmethod
    def from_metrics(cls, text: str) -> TakenBack:
        totals = {"evicted": 0.0, "suspended": 0.0, "recomputed_prompt_tokens": 0.0}
        waited: dict[float, float] = {}  # bucket bound -> requests suspended at most that long
        for family in text_string_to_metric_families(text):
            name = family.name.removeprefix("tokenpools_")
            if name in totals:
                totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif name == "suspended_seconds":
                for sample in family.samples:
                    if sample.name.endswith("_bucket"):
                        bound = float(sample.labels["le"])
                        waited[bound] = waited.get(bound, 0.0) + sample.value
        return cls(
            int(totals["evicted"]),
            int(totals["suspended"]),
            int(totals["recomputed_prompt_tokens"]),
            _quantile(waited, 0.5),
            _quantile(waited, 0.99),
        )


def _quantile(cumulative: dict[float, float], q: float) -> float | None:
    """The q-quantile of a histogram given as cumulative counts by upper bound."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            return round(lower + (bound - lower) * (rank - below) / max(count - below, 1e-12), 3)
        lower, below = bound, count
    return lower


class DemoResults(NamedTuple):
    with_tokenpools: RunResult
    without: RunResult
    taken_back: TakenBack


async def _emulator(profile: str, speed: float) -> tuple[subprocess.Popen[bytes], str]:
    """An emulated backend in its own process, so its steps keep time whatever the load
    generator and the gateway do in this one."""
    return await spawn_server(
        lambda port: ["emulate", "--profile", profile, "--speed", str(speed), "--port", str(port)],
        "/health",
    )


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def gateway_config(
    scenario: Scenario, backend: str, keys: dict[str, str], ledger: Path
) -> dict[str, Any]:
    """The scenario's tokenpools config, with the backend, the model, the tenants' keys and
    a usage ledger of the demo's own (never the user's default one)."""
    data = copy.deepcopy(scenario.tokenpools)
    data["usage"] = {"database": f"sqlite:///{ledger.resolve()}", "deployment": "demo"}
    pool = data["pools"][0]
    pool["backends"] = [{"url": backend}]
    pool["servedModels"] = [MODEL]
    data["gateway"] = {"adminKeys": [hash_key(ADMIN_KEY)]}
    by_entitlement = {t.entitlement or t.name: t.name for t in scenario.tenants}
    for ent in data["entitlements"]:
        tenant = by_entitlement.get(ent["name"])
        if tenant is not None:
            ent["apiKeys"] = [hash_key(keys[tenant])]
    return data


def without_entitlements(data: dict[str, Any], names: set[str]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    out["entitlements"] = [e for e in out["entitlements"] if e["name"] not in names]
    return out


async def run_demo(
    scenario: Scenario,
    speed: float = 1.0,
    progress: Callable[[float], None] | None = None,
    ledger: Path | None = None,
) -> DemoResults:
    """`ledger`: the SQLite file of the demo's usage (default: one in a temporary folder)."""
    if ledger is None:
        ledger = Path(tempfile.mkdtemp(prefix="tokenpools-demo-")) / "usage.sqlite3"
    profile = load_profile(scenario.engine.profile)
    keys = {t.name: f"sk-demo-{t.name}" for t in scenario.tenants}
    emu_with, url_with = await _emulator(scenario.engine.profile, speed)
    emu_without, url_without = await _emulator(scenario.engine.profile, speed)
    profile = profile.faster(speed)  # demand in slots follows the engines' pace
    data = gateway_config(scenario, url_with, keys, ledger)
    joining = {t.entitlement or t.name: t for t in scenario.tenants if t.entitlement_while_active}
    absent = set(joining)
    gateway = Gateway(parse_config(without_entitlements(data, absent)))
    gw_runner, gw_url = await _serve(make_gateway(gateway))

    def change(ent: str, join: bool) -> Callable[[], Awaitable[None]]:
        async def apply() -> None:
            if join:
                absent.discard(ent)
            else:  # leaving: the entitlement expires now; its requests in flight finish
                for e in data["entitlements"]:
                    if e["name"] == ent:
                        e["expiresAt"] = datetime.now(UTC)
            await gateway.reload(parse_config(without_entitlements(data, absent)))

        return apply

    timeline: list[tuple[float, Callable[[], Any]]] = []
    for ent, tenant in joining.items():
        timeline.append((tenant.workload.start_s, change(ent, True)))
        if tenant.workload.end_s is not None:
            timeline.append((tenant.workload.end_s, change(ent, False)))
    with_tp = LoadRun(
        scenario,
        {t: Target(gw_url, k) for t, k in keys.items()},
        MODEL,
        profile,
        backend_metrics_url=f"{url_with}/metrics",
        admin_url=gw_url,
        admin_key=ADMIN_KEY,
        label="tokenpools",
        timeline=timeline,
    )
    without = LoadRun(
        scenario,
        {t: Target(url_without, k) for t, k in keys.items()},
        MODEL,
        profile,
        backend_metrics_url=f"{url_without}/metrics",
        label="none",
    )
    try:
        results = await asyncio.gather(with_tp.run(progress), without.run())
        async with aiohttp.ClientSession() as http, http.get(f"{gw_url}/metrics") as reply:
            taken_back = TakenBack.from_metrics(await reply.text())
    finally:
        await gw_runner.cleanup()
        stop(emu_with, emu_without)
    return DemoResults(results[0], results[1], taken_back)


def headline(result: RunResult, overload: str) -> dict[str, float]:
    """{"guaranteed_ttft_p99_s", "spot_rejected_fraction", "max_backend_waiting",
    "busy_in_overload"}: the worst P99 TTFT of any guaranteed tenant in any phase; the share of
    spot's demand refused during the overload phase (1 − admitted / new requests); the largest
    backend queue sampled; the share of the backend's slots running requests in the overload."""
    summary = summarize(result)
    worst = 0.0
    spot = 0.0
    for data in summary["tenants"].values():
        if data["class"] == "guaranteed":
            for m in data["phases"].values():
                worst = max(worst, m["ttft_p99_s"] or 0.0)
        if data["class"] == "spot" and overload in data["phases"]:
            spot = data["phases"][overload]["throttled_fraction"]
    return {
        "guaranteed_ttft_p99_s": worst,
        "spot_rejected_fraction": spot,
        "max_backend_waiting": summary["engine"]["max_waiting"],
        "busy_in_overload": summary["utilization"].get(overload) or 0.0,
    }


def write_demo(scenario: Scenario, demo: DemoResults, out: Path, json_path: Path | None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    results = (demo.with_tokenpools, demo.without)
    summary = {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "policies": {r.policy: summarize(r) for r in results},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_figures(list(results), out)
    phases = [p.name for p in scenario.phases]
    overload = "overload" if "overload" in phases else phases[min(1, len(phases) - 1)]
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps(
                {
                    "with_tokenpools": headline(results[0], overload) | asdict(demo.taken_back),
                    "without": headline(results[1], overload),
                },
                indent=2,
            )
            + "\n"
        )
    busy = [summarize(r)["utilization"].get(overload) or 0.0 for r in results]
    back = demo.taken_back
    return (
        policy_table(scenario, summary)
        + f"\n\nBackend slots busy in the {overload}: {busy[0]:.0%} behind tokenpools "
        f"({results[0].policy}), {busy[1]:.0%} without ({results[1].policy}).\n"
        f"Taken back behind tokenpools: {back.taken_back} requests, {back.suspensions} of them "
        f"suspended rather than ended; {back.recomputed_prompt_tokens:,} prompt tokens "
        "prefilled again by the resumptions; time suspended P50 "
        f"{_seconds(back.suspended_p50_s)}, P99 {_seconds(back.suspended_p99_s)}.\n"
    )


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"
