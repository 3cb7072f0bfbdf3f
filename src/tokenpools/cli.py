"""The `tokenpools` command."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from tokenpools import core_build
from tokenpools.commands.backend import backend_app
from tokenpools.commands.common import fail, progress
from tokenpools.commands.config import CONFIG_COMMANDS
from tokenpools.commands.hosts import HOST_COMMANDS
from tokenpools.commands.k8s import k8s_app, operator
from tokenpools.commands.top import top
from tokenpools.commands.usage import usage
from tokenpools.model.config import ConfigError
from tokenpools.shipped import SCENARIOS, scenario_path

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


def _version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        typer.echo(f"tokenpools {version('tokenpools')} (decision core: {core_build()})")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """tokenpools: token-pool admission control for multi-tenant LLM inference."""


class Scheduling(StrEnum):
    """How the engines order their queues (vLLM's --scheduling-policy)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


@app.command()
def simulate(
    scenario: Annotated[
        str, typer.Argument(help="a scenario YAML file, or a shipped one's name (paper-exp1)")
    ],
    policy: Annotated[
        list[str] | None, typer.Option("--policy", "-p", help="repeatable; default: all")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="default: the scenario's")] = None,
    out: Annotated[Path, typer.Option(help="output folder")] = Path("out/simulate"),
    scheduling_policy: Annotated[
        Scheduling | None,
        typer.Option(help="the engines' (vLLM's --scheduling-policy); default: the scenario's"),
    ] = None,
) -> None:
    """Simulate one scenario under one or more admission policies."""
    from tokenpools.sim.experiments import run_scenario, write_outputs
    from tokenpools.sim.policies import POLICIES
    from tokenpools.sim.report import policy_table
    from tokenpools.sim.scenario import load_scenario

    policies = policy or list(POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        fail(f"unknown policy {unknown[0]!r} (known: {', '.join(POLICIES)})")
    try:
        loaded = load_scenario(scenario_path(scenario))
        if scheduling_policy is not None:
            loaded = loaded.on_engines(scheduling_policy.value)
        with progress(loaded.duration_s) as advance:
            summary, results = run_scenario(loaded, policies, seed, advance)
    except ConfigError as exc:
        fail(str(exc))
    write_outputs(loaded, summary, results, out)
    typer.echo(policy_table(loaded, summary))
    drawn = " and figures" if any(out.glob("*.png")) else ""
    typer.echo(f"\nwrote {out / 'summary.json'}, {out / 'report.md'}{drawn}")


@app.command()
def experiments(
    out: Annotated[Path, typer.Option(help="output folder")] = Path("out/experiments"),
    folder: Annotated[
        Path | None, typer.Option(help="scenario folder; default: the shipped scenarios")
    ] = None,
    policy: Annotated[
        list[str] | None, typer.Option("--policy", "-p", help="repeatable; default: all")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="default: each scenario's")] = None,
    scheduling_policy: Annotated[
        list[Scheduling] | None,
        typer.Option(help="the engines' (vLLM's --scheduling-policy), repeatable; default: both"),
    ] = None,
) -> None:
    """Run every scenario of a folder (the shipped ones by default) under every policy, on
    engines that schedule first come first served and by priority, into one report."""
    from tokenpools.sim.experiments import run_experiments
    from tokenpools.sim.policies import POLICIES

    try:
        with progress(None) as advance:
            index = run_experiments(
                folder or SCENARIOS,
                out,
                policy or list(POLICIES),
                seed,
                lambda s, p, t: advance(f"{s} {p}", t),
                engines=[m.value for m in scheduling_policy or list(Scheduling)],
            )
    except ConfigError as exc:
        fail(str(exc))
    typer.echo(f"wrote {index}")


@app.command()
def emulate(
    profile: Annotated[str, typer.Option(help="an engine profile name or YAML file")] = (
        "paper-dgx-spark-qwen3-8b"
    ),
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="listen port")] = 8000,
    speed: Annotated[
        float, typer.Option(help="time runs this many times faster; 0: no delay")
    ] = 1.0,
    scheduling_policy: Annotated[
        Scheduling,
        typer.Option(help="vLLM's: fcfs, or priority (a body's `priority`, lower served first)"),
    ] = Scheduling.FCFS,
) -> None:
    """Run an OpenAI-compatible server driven by the engine model in real time."""
    from aiohttp import web

    from tokenpools.emulator.app import make_app
    from tokenpools.engine.profile import ProfileError, load_profile

    try:
        loaded = load_profile(profile)
    except ProfileError as exc:
        fail(str(exc))
    web.run_app(
        make_app(loaded, speed, scheduling_policy.value),
        host=host,
        port=port,
        handler_cancellation=True,
        access_log=None,
    )


@app.command()
def demo(
    scenario: Annotated[
        str, typer.Option(help="the scenario to replay: a file, or a shipped one's name")
    ] = "paper-exp1",
    out: Annotated[Path, typer.Option(help="output folder")] = Path("out/demo"),
    json_path: Annotated[Path | None, typer.Option("--json", help="write the headline")] = None,
    speed: Annotated[float, typer.Option(help="emulated engines run this much faster")] = 1.0,
) -> None:
    """Replay a scenario over real HTTP through the gateway and, at the same time, straight to
    an identical backend without admission control; compare."""
    import asyncio

    from tokenpools.demo import run_demo, write_demo
    from tokenpools.sim.scenario import load_scenario

    try:
        loaded = load_scenario(scenario_path(scenario))
    except ConfigError as exc:
        fail(str(exc))
    typer.echo(
        f"replaying {loaded.name} ({loaded.duration_s:g} s) through the tokenpools gateway and, "
        "in parallel, straight to an identical emulated backend..."
    )
    with progress(loaded.duration_s) as advance:
        ledger = out / "usage.sqlite3"  # the demo's own; the user's default ledger stays apart
        results = asyncio.run(run_demo(loaded, speed, lambda t: advance("over HTTP", t), ledger))
    typer.echo(write_demo(loaded, results, out, json_path))
    drawn = " and figures" if any(out.glob("*.png")) else ""
    typer.echo(f"\nwrote {out / 'summary.json'}{drawn}" + (f", {json_path}" if json_path else ""))


@app.command()
def load(
    scenario: Annotated[
        str, typer.Argument(help="a scenario file or a shipped one's name: its tenants' load")
    ],
    target: Annotated[str, typer.Option(help="base URL: the gateway, or a backend")],
    key: Annotated[
        list[str] | None, typer.Option(help="TENANT=API_KEY, repeatable; default sk-TENANT")
    ] = None,
    model: Annotated[str, typer.Option(help="the model name to send")] = "qwen3-8b",
    metrics_url: Annotated[str | None, typer.Option(help="a backend's /metrics")] = None,
    json_path: Annotated[Path, typer.Option("--json", help="where to write the summary")] = Path(
        "out/load.json"
    ),
    ignore_eos: Annotated[
        bool, typer.Option(help="ask a real engine for exactly max_tokens (llama.cpp, vLLM)")
    ] = False,
) -> None:
    """Replay a scenario's tenants (open or closed loop, retries as configured) over HTTP and
    measure TTFT, TPOT and E2E client-side; writes the simulator's summary.json shape."""
    import asyncio
    import json

    from tokenpools.engine.profile import load_profile
    from tokenpools.loadgen import LoadRun, Target
    from tokenpools.sim.metrics import summary_json
    from tokenpools.sim.report import policy_table
    from tokenpools.sim.scenario import load_scenario

    keys = {}
    for item in key or []:
        tenant, sep, value = item.partition("=")
        if not sep or not value:
            fail(f"--key wants TENANT=API_KEY, got {item!r}")
        keys[tenant] = value
    try:
        loaded = load_scenario(scenario_path(scenario))
        profile = load_profile(loaded.engine.profile)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    targets = {
        t.name: Target(target.rstrip("/"), keys.get(t.name, f"sk-{t.name}")) for t in loaded.tenants
    }
    run = LoadRun(
        loaded,
        targets,
        model,
        profile,
        backend_metrics_url=metrics_url,
        label="load",
        extra_body={"ignore_eos": True} if ignore_eos else {},
    )
    with progress(loaded.duration_s) as advance:
        result = asyncio.run(run.run(lambda t: advance("load", t)))
    summary = summary_json(result)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    typer.echo(policy_table(loaded, summary))
    typer.echo(f"\nwrote {json_path}")


for name, command in (CONFIG_COMMANDS | HOST_COMMANDS).items():
    app.command(name)(command)
app.add_typer(backend_app, name="backend")
app.add_typer(k8s_app, name="k8s")
app.command()(operator)
app.command()(top)
app.command()(usage)

if __name__ == "__main__":
    app()
