"""The commands that help write a config: check one, print the schema or the example, make
and hash API keys."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tokenpools import core_build
from tokenpools.commands.common import fail
from tokenpools.control.core import DecisionCore
from tokenpools.model.config import ConfigError, load_config
from tokenpools.model.entitlement import BindingState
from tokenpools.model.keys import hash_key
from tokenpools.shipped import EXAMPLE_CONFIG
from tokenpools.state.memory import MemoryStore


def check_config(
    path: Annotated[Path, typer.Argument(help="the YAML config file")],
) -> None:
    """Validate a config; show pools and entitlements with binding state and priority."""
    # Off a terminal (a pipe, CI) rich assumes 80 columns and truncates every cell.
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        config = load_config(path)
    except ConfigError as exc:
        fail(str(exc))
    core = DecisionCore(config, MemoryStore(), now=time.time())

    pools = Table(title=f"pools in {path}", title_justify="left")
    for column in ("pool", "model", "KV B/token", "replicas", "tokens/s", "KV tokens", "seqs"):
        pools.add_column(column, justify="left" if column in ("pool", "model") else "right")
    pools.add_column("ℓ̄* ms", justify="right")
    pools.add_column("desired", justify="right")
    for name, pool_view in core.pools.items():
        pool = pool_view.pool
        cap = pool.capacity
        pools.add_row(
            name,
            pool.model.name,
            f"{pool.model.kv_bytes_per_token:,.0f}",
            f"{pool.replicas} ({pool.min_replicas}–{pool.max_replicas})",
            f"{cap.throughput:,.0f}",
            f"{cap.kv_tokens:,.0f}",
            f"{cap.concurrency:g}",
            f"{pool_view.slo_reference_ms:,.0f}",
            str(core.desired_replicas(name)),
        )
    console.print(pools)

    ents = Table(title="entitlements", title_justify="left")
    for column in ("entitlement", "tenant", "pool", "class", "state"):
        ents.add_column(column)
    for column in ("tokens/s", "KV tokens", "seqs", "SLO ms", "priority"):
        ents.add_column(column, justify="right")
    styles = {BindingState.BOUND: "green", BindingState.EXPIRED: "dim"}
    for name, view in core.entitlements.items():
        ent = view.ent
        base = ent.baseline
        style = styles.get(view.state, "yellow")
        ents.add_row(
            name,
            ent.tenant_id,
            ent.pool,
            ent.service_class.value,
            f"[{style}]{view.state.value}[/]",
            f"{base.throughput:,.1f}",
            f"{base.kv_tokens:,.0f}",
            f"{base.concurrency:g}",
            "–" if ent.slo_target_ms is None else f"{ent.slo_target_ms:,.0f}",
            f"{view.priority:.1f}",
        )
    console.print(ents)
    unbound = [n for n, v in core.entitlements.items() if v.state != BindingState.BOUND]
    if unbound:
        console.print(f"[yellow]not bound:[/] {', '.join(unbound)}")
    console.print(f"decision core: {core_build()}")
    state = config.state
    if state.backend == "redis":  # not contacted here: checking a file needs no Redis
        console.print(
            f"state: shared in Redis at {state.url} (timeout {state.timeout_s * 1000:g} ms; "
            f"while unreachable, protected classes get {state.fallback_fraction:g} of their "
            "baseline per replica, the others 503)"
        )
    console.print(f"[green]ok[/]: {len(core.pools)} pools, {len(core.entitlements)} entitlements")


def hash_key_command(
    key: Annotated[
        str | None, typer.Argument(help="an API key; default: read from standard input")
    ] = None,
) -> None:
    """Print the sha256 hash of an API key, for the config's apiKeys and adminKeys. Without an
    argument the key is read from standard input, so it stays out of the shell's history."""
    if key is None:
        key = sys.stdin.readline().strip()
    if not key:
        fail("no key given (as an argument or on standard input)")
    typer.echo(hash_key(key))


def gen_key(
    prefix: Annotated[str, typer.Option(help="what the key starts with")] = "sk-tp-",
) -> None:
    """Print a new random API key (32 bytes from the OS's generator) and, on standard error,
    its hash for the config."""
    import secrets

    key = prefix + secrets.token_urlsafe(32)
    typer.echo(key)
    typer.echo(f"hash for apiKeys: {hash_key(key)}", err=True)


def schema() -> None:
    """Print the config file's JSON Schema (for editors and CI checks)."""
    import json

    from tokenpools.model.config_schema import ConfigSpec

    typer.echo(json.dumps(ConfigSpec.model_json_schema(), indent=2))


def example_config() -> None:
    """Print the example config to start from (the paper's two experiments: two pools, with
    guaranteed, spot, preemptible and elastic tenants)."""
    typer.echo(EXAMPLE_CONFIG.read_text(), nl=False)


CONFIG_COMMANDS: dict[str, Callable[..., None]] = {
    "check-config": check_config,
    "schema": schema,
    "example-config": example_config,
    "gen-key": gen_key,
    "hash-key": hash_key_command,
}
