"""tokenpools against LiteLLM's proxy: one run, one machine, one emulated backend, the same load.

Targets: `direct` (the emulator itself), `tokenpools` (`tokenpools serve`), `litellm` (LiteLLM's
proxy, no limits), `litellm-limits` (LiteLLM with its own per-key limiter, the keys handed out
by benchmarks/litellm_native_limits.py instead of its database), `litellm-tokenpools` (LiteLLM
with tokenpools.integrations.litellm). Every server is its own process, one worker each; with
`--pin` the servers run on core 1 and the emulator and this client on core 0, so a server's
numbers are those of one core.

(a) Overhead and ceiling, per mode (non-streaming, streaming): `--rate` req/s open loop for
`--seconds`, repeated `--repeats` times with the targets interleaved: p50/p99 latency (added =
minus direct's) and the server's CPU per request; then a closed loop of 32 clients per target:
max req/s. The emulator runs at `--speed 0` (no step delay): what is measured is the servers.
Also each server's start-up time and resident memory after the load, and the integration's
own CPU per request measured inside LiteLLM's interpreter (benchmarks/litellm_hook_cost.py).

(b) The paper's experiment 1 over HTTP (the load of `tokenpools load paper-exp1`) through
`tokenpools`, `litellm-tokenpools`, LiteLLM's own limits in two settings and plain `litellm`,
one after the other, each with an emulator of its own in real time, `--exp1-repeats` times
(headline: the median; every run kept). guaranteed-c's entitlement is written into the
tokenpools config file 3 s before it joins and expires when it leaves. LiteLLM's per-key
limits are static ceilings: `litellm-limits` lets each guaranteed key run its 6 sequences and
spot the 4 left of 16 (it protects them); `litellm-limits-spot10` gives spot 10, what is left
while guaranteed-c is away (it uses the engine).

    make .venv-litellm/.built
    .venv-pure/bin/python benchmarks/vs_litellm.py --json out/vs_litellm.json --pin
    .venv-pure/bin/python benchmarks/vs_litellm.py --json /tmp/vs_litellm.json --smoke  # tests'

`--smoke`: (a) 0.1 s per run, once; (b) once per target, the scenario's every time compressed
into 2 s (`--exp1-seconds`), its emulator as much faster. Most of its minute is LiteLLM's
start-up (~6 s of imports per proxy, seven proxies).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from gateway import KEY, MODEL, bench_config, closed_loop, fixed_rate, measured, pct
from smoke import parse_args
from tokenpools.demo import gateway_config, headline, without_entitlements
from tokenpools.engine.profile import load_profile
from tokenpools.loadgen import LoadRun, Target
from tokenpools.processes import free_port, stop, wait_ready
from tokenpools.shipped import scenario_path
from tokenpools.sim.metrics import summarize
from tokenpools.sim.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parent.parent
HOOK = "tokenpools.integrations.litellm"
LITELLM_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch from the internet at start
    "REPEATED_STREAMING_CHUNK_LIMIT": "1000000",  # the emulator repeats one word
    "LITELLM_LOG": "ERROR",
}
MASTER_KEY = KEY  # plain LiteLLM: the benchmark's clients send the master key
Timeline = list[tuple[float, Callable[[], Awaitable[None] | None]]]
# The JSON (paths as in benchmarks/smoke.py): (a) a row per mode and target, each server's
# start-up and memory, the hook's own cost; (b) per target the medians and every run.
FIELDS = (
    "pinned", "litellm",
    "rows.[].target", "rows.[].mode", "rows.[].max_rps", "rows.[].max_rps_runs",
    "rows.[].added_p50_ms", "rows.[].added_p99_ms", "rows.[].p50_ms", "rows.[].p99_ms",
    "rows.[].cpu_ms_per_req", "rows.[].cpu_ms_per_req_at_rate", "rows.[].rate_rps",
    "servers.tokenpools.start_s", "servers.tokenpools.rss_mib",
    "servers.litellm.start_s", "servers.litellm-limits.start_s",
    "servers.litellm-tokenpools.start_s", "servers.*.rss_mib",
    "hook_cost.us_per_request", "hook_cost.runs_us",
    "exp1.tokenpools.guaranteed_ttft_p99_s", "exp1.litellm-tokenpools.guaranteed_ttft_p99_s",
    "exp1.litellm-limits.guaranteed_ttft_p99_s",
    "exp1.litellm-limits-spot10.guaranteed_ttft_p99_s", "exp1.litellm.guaranteed_ttft_p99_s",
    "exp1.*.guaranteed_ttft_p99_overload_s", "exp1.*.utilization", "exp1.*.spot_goodput_rps",
    "exp1.*.max_backend_waiting",
    "exp1.*.runs.[].guaranteed_ttft_p99_s", "exp1.*.runs.[].guaranteed_ttft_p99_overload_s",
    "exp1.*.runs.[].utilization", "exp1.*.runs.[].utilization_per_phase",
    "exp1.*.runs.[].spot_goodput_rps", "exp1.*.runs.[].spot_rejected_fraction_overload",
    "exp1.*.runs.[].max_backend_waiting", "exp1.*.runs.[].server_cpu_s",
    "exp1.*.runs.[].phases.guaranteed-a.overload.ttft_p99_s",
    "exp1.*.runs.[].phases.spot-b.overload.throttled_fraction",
    "exp1.*.runs.[].phases.*.before.goodput_rps",
)  # fmt: skip
SMOKE = {"seconds": 0.1, "repeats": 1, "rate": 30.0, "exp1_repeats": 1, "exp1_seconds": 2.0}


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    start_s: float

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


async def launch(
    command: list[str], env: dict[str, str], ready: str, cpus: str | None, log: Path
) -> Server:
    """Start a server (its output in `log`) and wait until `ready` answers 200."""
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]  # taskset execs: the pid is the server's
    port = free_port()
    started = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, "--port", str(port)],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url + ready, proc, timeout_s=180)
    except RuntimeError:
        sys.stderr.write(log.read_text()[-3000:])
        raise
    return Server(url, proc, time.perf_counter() - started)


def litellm_config(backend: str, model: str, auth: str | None, hook: bool) -> dict[str, Any]:
    params = {"model": f"openai/{model}", "api_base": f"{backend}/v1", "api_key": "none"}
    config: dict[str, Any] = {
        "model_list": [{"model_name": model, "litellm_params": params}],
        "litellm_settings": {"num_retries": 0, "request_timeout": 600},
        "general_settings": {},
    }
    if auth is not None:
        config["general_settings"]["custom_auth"] = auth
    if hook:
        config["litellm_settings"]["callbacks"] = f"{HOOK}.proxy_handler_instance"
    return config


class Lab:
    """Starts the servers of one comparison in a scratch directory, and stops them all."""

    def __init__(self, litellm: Path, cpus: str | None) -> None:
        self.litellm = litellm
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix="vs-litellm-"))
        shutil.copy(Path(__file__).parent / "litellm_native_limits.py", self.dir)
        self.servers: list[Server] = []

    async def emulator(self, profile: str, speed: float) -> Server:
        command = [sys.executable, "-m", "tokenpools.cli", "emulate", "--profile", profile]
        log = self.dir / "emulator.log"
        server = await launch([*command, "--speed", str(speed)], {}, "/health", None, log)
        self.servers.append(server)
        return server

    async def tokenpools(self, name: str, config: dict[str, Any]) -> Server:
        path = self.write(f"{name}.yaml", config)
        command = [sys.executable, "-m", "tokenpools.cli", "serve", "--config", str(path)]
        server = await launch(command, {}, "/readyz", self.cpus, self.dir / f"{name}.log")
        self.servers.append(server)
        return server

    async def litellm_proxy(
        self,
        name: str,
        backend: str,
        model: str,
        tokenpools: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
    ) -> Server:
        """LiteLLM's proxy: with neither tokenpools nor limits, clients send the master key."""
        env = {**LITELLM_ENV, "LITELLM_MASTER_KEY": MASTER_KEY}
        auth = None
        if tokenpools is not None:
            env["TOKENPOOLS_CONFIG"] = str(self.write(f"{name}-tokenpools.yaml", tokenpools))
            auth = f"{HOOK}.user_api_key_auth"
        if limits is not None:
            env["BENCH_LITELLM_LIMITS"] = json.dumps(limits)
            auth = "litellm_native_limits.user_api_key_auth"
        config = litellm_config(backend, model, auth, tokenpools is not None)
        path = self.write(f"{name}.yaml", config)
        command = [str(self.litellm), "--config", str(path), "--host", "127.0.0.1"]
        log = self.dir / f"{name}.log"
        server = await launch(command, env, "/health/liveliness", self.cpus, log)
        self.servers.append(server)
        return server

    def write(self, name: str, data: dict[str, Any]) -> Path:
        path = self.dir / name
        path.write_text(yaml.safe_dump(data))
        return path

    def close(self) -> None:
        stop(*(s.proc for s in self.servers))
        shutil.rmtree(self.dir, ignore_errors=True)


def without_backends(config: dict[str, Any]) -> dict[str, Any]:
    """A tokenpools config for inside LiteLLM: LiteLLM routes, so the pools name no backend."""
    out = copy.deepcopy(config)
    for pool in out["pools"]:
        pool.pop("backends", None)
    return out


async def overhead(args: argparse.Namespace, litellm: Path) -> dict[str, Any]:
    lab = Lab(litellm, "1" if args.pin else None)
    try:
        emulator = await lab.emulator("h100-llama3.1-8b", 0)
        config = bench_config(emulator.url)
        unlimited = {"max_parallel_requests": 10**6, "rpm_limit": 10**9, "tpm_limit": 10**12}
        targets: dict[str, Server | None] = {
            "direct": None,
            "tokenpools": await lab.tokenpools("tokenpools", config),
            "litellm": await lab.litellm_proxy("litellm", emulator.url, MODEL),
            "litellm-limits": await lab.litellm_proxy(
                "litellm-limits", emulator.url, MODEL, limits={KEY: {"set": unlimited}}
            ),
            "litellm-tokenpools": await lab.litellm_proxy(
                "litellm-tokenpools", emulator.url, MODEL, tokenpools=without_backends(config)
            ),
        }
        urls = {t: (s.url if s else emulator.url) for t, s in targets.items()}
        runs: dict[tuple[str, str], list[tuple[list[float], float]]] = {}
        ceilings: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.repeats):  # interleaved: the machine's drift hits every target
            for stream in (False, True):
                mode = "streaming" if stream else "non-streaming"
                for target, server in targets.items():
                    proc = server.proc if server else None
                    work = fixed_rate(urls[target], stream, args.rate, args.seconds)
                    runs.setdefault((mode, target), []).append(await measured(proc, work))
                    work = closed_loop(urls[target], 32, args.seconds, stream)
                    ceilings.setdefault((mode, target), []).append(await measured(proc, work))
        rows = []
        for (mode, target), got in runs.items():
            direct = runs[(mode, "direct")]
            p50 = statistics.median(pct(lat, 50) for lat, _ in got)
            p99 = statistics.median(pct(lat, 99) for lat, _ in got)
            requests = sum(len(lat) for lat, _ in got)
            peak = [rps for rps, _ in ceilings[(mode, target)]]
            row = {
                "target": target,
                "mode": mode,
                "max_rps": statistics.median(peak),
                "max_rps_runs": peak,
                "added_p50_ms": (p50 - statistics.median(pct(d, 50) for d, _ in direct)) * 1000,
                "added_p99_ms": (p99 - statistics.median(pct(d, 99) for d, _ in direct)) * 1000,
                "p50_ms": p50 * 1000,
                "p99_ms": p99 * 1000,
                # at the ceiling, where background work (ticks, health checks) weighs nothing
                "cpu_ms_per_req": statistics.median(
                    cpu / (rps * args.seconds) * 1000 for rps, cpu in ceilings[(mode, target)]
                ),
                "cpu_ms_per_req_at_rate": sum(cpu for _, cpu in got) / requests * 1000,
                "rate_rps": args.rate,
            }
            rows.append(row)
            print(
                f"{mode:13s} {target:18s} max {row['max_rps']:7.0f} req/s, added p50 "
                f"{row['added_p50_ms']:6.2f} ms p99 {row['added_p99_ms']:6.2f} ms, "
                f"CPU {row['cpu_ms_per_req']:.3f} ms/req",
                file=sys.stderr,
            )
        servers = {
            t: {"start_s": round(s.start_s, 2), "rss_mib": round(s.rss_mib(), 1)}
            for t, s in targets.items()
            if s is not None
        }
        return {"rows": rows, "servers": servers, "hook_cost": hook_cost(lab, litellm)}
    finally:
        lab.close()


# LiteLLM's keys have static limits, and a limit is a ceiling, not a reservation: each
# guaranteed key may run its 6 sequences; spot may run 4 (what the two leave of 16: it protects
# them) or 10 (what guaranteed-a leaves while guaranteed-c is away: it uses the engine).
NATIVE_SPOT_SLOTS = {"litellm-limits": 4, "litellm-limits-spot10": 10}
EXP1_TARGETS = ("tokenpools", "litellm-tokenpools", *NATIVE_SPOT_SLOTS, "litellm")
JOIN_LEAD_S = 3.0  # a config file is followed every 2 s: it is written this early


def joining(
    scenario: Scenario, config: dict[str, Any], path: Path
) -> tuple[dict[str, Any], Timeline]:
    """Tenants whose entitlement exists only while they take part (guaranteed-c): the config
    to start with, without them; and the timeline that rewrites the file at `path` with theirs
    before they join, expiring when they leave, as an operator would provision them."""
    late = {t.entitlement or t.name: t for t in scenario.tenants if t.entitlement_while_active}
    timeline: Timeline = []
    for name, tenant in late.items():
        start, end = tenant.workload.start_s, tenant.workload.end_s

        def join(start: float = start, end: float | None = end, name: str = name) -> None:
            data = copy.deepcopy(config)
            for ent in data["entitlements"]:
                if ent["name"] == name and end is not None:
                    ent["expiresAt"] = datetime.now(UTC) + timedelta(seconds=end - start + 3)
            path.write_text(yaml.safe_dump(data))

        timeline.append((max(0.0, start - JOIN_LEAD_S), join))
    return without_entitlements(config, set(late)), timeline


def hook_cost(lab: Lab, litellm: Path) -> dict[str, Any]:
    """The integration's own CPU per request inside LiteLLM's interpreter, LiteLLM's server
    left out (benchmarks/litellm_hook_cost.py), on the servers' core."""
    script = Path(__file__).parent / "litellm_hook_cost.py"
    config = lab.dir / "litellm-tokenpools-tokenpools.yaml"
    command = [str(litellm.parent / "python"), str(script), str(config), MODEL, KEY]
    if lab.cpus is not None:
        command = ["taskset", "-c", lab.cpus, *command]
    out = subprocess.run(
        command, env={**os.environ, **LITELLM_ENV}, capture_output=True, text=True, check=True
    ).stdout
    cost: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    print(f"the hook's own CPU: {cost['us_per_request']:.0f} µs per request", file=sys.stderr)
    return cost


def compressed(scenario: Scenario, seconds: float) -> Scenario:
    """The scenario in `seconds`: its every time (phases, joins and leaves, changes, capacity
    events) scaled alike."""
    f = seconds / scenario.duration_s
    data = scenario.model_dump()
    data["duration_s"] = seconds
    for phase in data["phases"]:
        phase["start_s"] *= f
        phase["end_s"] *= f
    for tenant in data["tenants"]:
        workload = tenant["workload"]
        workload["start_s"] *= f
        if workload["end_s"] is not None:
            workload["end_s"] *= f
        tenant["entitlement_lead_s"] *= f
        for change in tenant["changes"]:
            change["at_s"] *= f
    for event in data["capacity"]:
        event["at_s"] *= f
    return Scenario.model_validate(data)


async def experiment1(args: argparse.Namespace, litellm: Path, target: str) -> dict[str, Any]:
    scenario = load_scenario(scenario_path("paper-exp1"))
    speed = 1.0  # the emulator in real time
    if args.exp1_seconds is not None:  # and as much faster as the scenario is compressed
        speed = scenario.duration_s / args.exp1_seconds
        scenario = compressed(scenario, args.exp1_seconds)
    keys = {t.name: f"sk-exp1-{t.name}" for t in scenario.tenants}
    model = "qwen3-8b"
    lab = Lab(litellm, "1" if args.pin else None)
    timeline: Timeline = []
    try:
        emulator = await lab.emulator(scenario.engine.profile, speed)
        config = gateway_config(scenario, emulator.url, keys, lab.dir / f"{target}-usage.sqlite3")
        config["pools"][0]["servedModels"] = [model]
        if target == "tokenpools":
            initial, timeline = joining(scenario, config, lab.dir / f"{target}.yaml")
            server = await lab.tokenpools(target, initial)
        elif target == "litellm-tokenpools":
            path = lab.dir / f"{target}-tokenpools.yaml"
            initial, timeline = joining(scenario, without_backends(config), path)
            server = await lab.litellm_proxy(target, emulator.url, model, initial)
        elif target in NATIVE_SPOT_SLOTS:
            slots = {"guaranteed-a": 6, "guaranteed-c": 6, "spot-b": NATIVE_SPOT_SLOTS[target]}
            limits = {
                keys[t.name]: {"alias": t.name, "set": {"max_parallel_requests": slots[t.name]}}
                for t in scenario.tenants
            }
            server = await lab.litellm_proxy(target, emulator.url, model, limits=limits)
        else:
            server = await lab.litellm_proxy(target, emulator.url, model)
            keys = {t: MASTER_KEY for t in keys}
        return await exp1_run(scenario, server, keys, model, emulator.url, target, timeline)
    finally:
        lab.close()


async def exp1_run(
    scenario: Scenario,
    server: Server,
    keys: dict[str, str],
    model: str,
    emulator_url: str,
    target: str,
    timeline: Timeline,
) -> dict[str, Any]:
    """Experiment 1's load through `server`, and its headline numbers (every target alike)."""
    run = LoadRun(
        scenario,
        {t: Target(server.url, k) for t, k in keys.items()},
        model,
        load_profile(scenario.engine.profile),
        backend_metrics_url=f"{emulator_url}/metrics",
        label=target,
        timeline=timeline,
    )
    result, cpu = await measured(server.proc, run.run())
    summary = summarize(result)
    head = headline(result, "overload")
    utilization = summary["utilization"]
    guaranteed = [t for t in summary["tenants"].values() if t["class"] == "guaranteed"]
    out = {
        "guaranteed_ttft_p99_s": head["guaranteed_ttft_p99_s"],  # the worst of any phase
        "guaranteed_ttft_p99_overload_s": max(
            t["phases"]["overload"]["ttft_p99_s"] or 0.0 for t in guaranteed
        ),
        "utilization": statistics.mean(utilization.values()),
        "utilization_per_phase": utilization,
        "spot_goodput_rps": summary["tenants"]["spot-b"]["totals"]["goodput_rps"],
        "spot_rejected_fraction_overload": head["spot_rejected_fraction"],
        "max_backend_waiting": head["max_backend_waiting"],
        "server_cpu_s": round(cpu, 2),
        "phases": {  # per tenant and phase: what the headline numbers come from
            name: {
                phase: {k: m[k] for k in ("ttft_p99_s", "throttled_fraction", "goodput_rps")}
                for phase, m in tenant["phases"].items()
            }
            for name, tenant in summary["tenants"].items()
        },
    }
    print(f"exp1 {target}: {out}", file=sys.stderr)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if not args.litellm.exists():
        raise SystemExit(f"{args.litellm} is missing: `make .venv-litellm/.built` installs it")
    if args.pin:  # this process (the client) shares core 0 with the emulator
        os.sched_setaffinity(0, {0})
    query = "import importlib.metadata as m; print(m.version('litellm'))"
    version = subprocess.run(
        [args.litellm.parent / "python", "-c", query], capture_output=True, text=True, check=True
    ).stdout.strip()
    result: dict[str, Any] = {"pinned": args.pin, "litellm": version}
    if not args.skip_overhead:
        result |= await overhead(args, args.litellm)
    if not args.skip_exp1:
        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in EXP1_TARGETS}
        for _ in range(args.exp1_repeats):  # interleaved, as in (a)
            for target in EXP1_TARGETS:
                runs[target].append(await experiment1(args, args.litellm, target))
        result["exp1"] = {target: medians(got) for target, got in runs.items()}
    return result


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each headline number's median over the runs, and every run as it was."""
    keys = (
        "guaranteed_ttft_p99_s",
        "guaranteed_ttft_p99_overload_s",
        "utilization",
        "spot_goodput_rps",
        "max_backend_waiting",
    )
    out: dict[str, Any] = {k: statistics.median(run[k] for run in runs) for k in keys}
    out["runs"] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=25.0, help="open-loop requests per second")
    parser.add_argument("--litellm", type=Path, default=ROOT / ".venv-litellm/bin/litellm")
    parser.add_argument("--pin", action="store_true", help="servers on core 1, the rest on 0")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-exp1", action="store_true")
    parser.add_argument("--exp1-repeats", type=int, default=3)
    parser.add_argument(
        "--exp1-seconds", type=float, help="compress (b)'s 90 s into these (default: real time)"
    )
    args = parse_args(parser, SMOKE)
    result = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
