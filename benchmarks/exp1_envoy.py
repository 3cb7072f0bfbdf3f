"""The paper's experiment 1 over HTTP through Envoy with tokenpools' ext_proc processor, side by
side in one run with `tokenpools serve` and with no admission at all.

Targets, each with an emulator of its own (the scenario's engine profile, in real time unless
`--seconds` compresses the scenario, the emulator as much faster):
`envoy-extproc` (client -> Envoy -> `tokenpools extproc` -> an EPP-protocol picker -> emulator,
as tests/envoy_setup.py configures Envoy), `tokenpools` (`tokenpools serve`) and `none` (Envoy
and the picker alone: nothing is admitted or refused). The load is `tokenpools load
paper-exp1`'s (tokenpools.loadgen), its numbers as benchmarks/vs_litellm.py reports them
(`exp1_run`); guaranteed-c's entitlement is written into the config file 3 s before it joins,
and both tokenpools hosts follow the file. `--repeats` runs per target, interleaved; the
headline is each number's median, every run kept.

The issue's goal: guaranteed P99 TTFT in the overload <= 1.5 s at >= 85 % utilisation through
Envoy + the processor.

    .venv-pure/bin/python benchmarks/exp1_envoy.py --json out/exp1_envoy.json
    .venv-pure/bin/python benchmarks/exp1_envoy.py --json /tmp/exp1_envoy.json --smoke  # tests'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' Envoy setup
from tests.envoy_setup import envoy_binary, envoy_config

from extproc import Lab
from smoke import parse_args
from tokenpools.demo import gateway_config
from tokenpools.processes import free_port
from tokenpools.shipped import scenario_path
from tokenpools.sim.scenario import load_scenario
from vs_litellm import Server, Timeline, compressed, exp1_run, joining, medians

TARGETS = ("envoy-extproc", "tokenpools", "none")
MODEL = "qwen3-8b"
TTFT_GOAL_S, UTILIZATION_GOAL = 1.5, 0.85
FIELDS = (
    "seconds", "repeats", "goal.ttft_p99_overload_s", "goal.utilization", "goal.met",
    "exp1.*.guaranteed_ttft_p99_overload_s", "exp1.*.guaranteed_ttft_p99_s",
    "exp1.*.utilization", "exp1.*.spot_goodput_rps", "exp1.*.max_backend_waiting",
    "exp1.*.runs.[].guaranteed_ttft_p99_overload_s", "exp1.*.runs.[].utilization",
    "exp1.*.runs.[].server_cpu_s",
)  # fmt: skip
SMOKE = {"seconds": 3.0, "repeats": 1}


async def envoy_in_front(
    lab: Lab, name: str, tokenpools_port: int | None, emulator_url: str
) -> str:
    """Envoy (with tokenpools' filter when `tokenpools_port` is given) and the picker, in
    front of the emulator; Envoy's listener URL."""
    _, picker_port = lab.picker(emulator_url.removeprefix("http://"))
    listen, admin = free_port(), free_port()
    config = envoy_config(listen, admin, tokenpools_port, picker_port, route_timeout_s=600.0)
    path = lab.dir / f"{name}-envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [envoy_binary(), "-c", str(path), "--log-level", "warning",
               "--base-id", str(admin), "--concurrency", "2"]  # fmt: skip
    proc = lab.spawn(command, f"{name}-envoy", None)
    await lab.ready(f"http://127.0.0.1:{admin}/ready", proc, f"{name}-envoy")
    return f"http://127.0.0.1:{listen}"


async def experiment1(args: argparse.Namespace, target: str) -> dict[str, Any]:
    scenario = load_scenario(scenario_path("paper-exp1"))
    speed = 1.0
    if args.seconds is not None:
        speed = scenario.duration_s / args.seconds
        scenario = compressed(scenario, args.seconds)
    keys = {t.name: f"sk-exp1-{t.name}" for t in scenario.tenants}
    lab = Lab(pin=False, access_log=False)
    timeline: Timeline = []
    try:
        port = free_port()
        emulate = ["emulate", "--profile", scenario.engine.profile, "--speed", str(speed)]
        command = [sys.executable, "-m", "tokenpools.cli", *emulate, "--port", str(port)]
        emulator = f"http://127.0.0.1:{port}"
        await lab.ready(f"{emulator}/health", lab.spawn(command, "emulator", None), "emulator")
        config = gateway_config(scenario, emulator, keys, lab.dir / "usage.sqlite3")
        config["pools"][0]["servedModels"] = [MODEL]
        path = lab.dir / f"{target}.yaml"
        initial, timeline = joining(scenario, config, path)
        path.write_text(yaml.safe_dump(initial))
        if target == "tokenpools":
            setup = await lab.gateway(path)
            server = Server(setup.url, setup.procs["tokenpools"], 0.0)
        elif target == "envoy-extproc":
            proc, grpc_port, _ = await lab.processor(path)
            server = Server(await envoy_in_front(lab, target, grpc_port, emulator), proc, 0.0)
        else:  # no admission: Envoy and the picker alone; its CPU is Envoy's
            url = await envoy_in_front(lab, target, None, emulator)
            server = Server(url, lab.procs[-1], 0.0)
            timeline = []
        return await exp1_run(scenario, server, keys, MODEL, emulator, target, timeline)
    finally:
        lab.close()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
    for _ in range(args.repeats):  # interleaved: the machine's drift hits every target
        for target in TARGETS:
            runs[target].append(await experiment1(args, target))
    exp1 = {target: medians(got) for target, got in runs.items()}
    ours = exp1["envoy-extproc"]
    met = (
        ours["guaranteed_ttft_p99_overload_s"] <= TTFT_GOAL_S
        and ours["utilization"] >= UTILIZATION_GOAL
    )
    goal = {"ttft_p99_overload_s": TTFT_GOAL_S, "utilization": UTILIZATION_GOAL, "met": met}
    return {"seconds": args.seconds, "repeats": args.repeats, "goal": goal, "exp1": exp1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--seconds", type=float, help="compress the scenario's 90 s into these (default: none)"
    )
    args = parse_args(parser, SMOKE)
    result = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
