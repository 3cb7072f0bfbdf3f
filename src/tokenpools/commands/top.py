"""`tokenpools top`: the dashboard's essentials in a terminal (rich Live), for operators on
SSH: the latest sample of `/admin/history` of one gateway replica, redrawn every few seconds."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from tokenpools.commands.common import fail


def _n(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def fetch(url: str, key: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url.rstrip('/')}/admin/history", headers={"Authorization": f"Bearer {key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5.0) as r:
            data: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            fail("the gateway refused that admin key")
        fail(f"{url}/admin/history answered {exc.code}: {exc.read()[:200]!r}")
    except (urllib.error.URLError, OSError) as exc:
        fail(f"cannot reach {url}: {exc}")
    return data


def render(history: dict[str, Any]) -> Group:
    samples = history["samples"]
    store = history["store"]
    title = (
        f"replica {history['replica']} · store {store['backend']} {'up' if store['up'] else 'DOWN'}"
    )
    pools = Table(title=title, title_justify="left")
    for column in ("pool", "replicas", "slots in flight", "held back", "KV tokens", "backends"):
        pools.add_column(column, justify="left" if column == "pool" else "right")
    ents = Table()
    columns = ["tenant", "entitlement", "pool", "class", "state", "in flight", "priority", "debt"]
    columns += ["admitted/s", "refused/s", "refused", "TTFT p99"]
    for column in columns:
        ents.add_column(column, justify="left" if column in columns[:5] else "right")
    if not samples:
        return Group(pools, "no sample yet: the gateway takes one per update period")
    latest = samples[-1]
    for name, p in latest["pools"].items():
        backends = history["backends"].get(name, [])
        healthy = sum(b["healthy"] for b in backends)
        pools.add_row(
            name,
            f"{p['replicas']} (desired {p['desired_replicas']})",
            f"{p['reserved']['concurrency']:g} of {p['capacity']['concurrency']:g}",
            f"{p['held_back']['concurrency']:g}",
            f"{p['reserved']['kv_tokens']:g} of {p['capacity']['kv_tokens']:g}",
            f"{healthy} of {len(backends)} healthy",
        )
    by_tenant = sorted(latest["entitlements"].items(), key=lambda i: (i[1].get("tenant", ""), i[0]))
    for name, e in by_tenant:  # a tenant's entitlements together
        refused = sum(v or 0.0 for v in e["refused_per_s"].values())
        ents.add_row(
            e.get("tenant", "-"),
            name,
            e["pool"],
            e["class"],
            e["state"],
            str(e["in_flight"]),
            _n(e["priority"], 1),
            _n(e["debt"], 3),
            _n(e["admitted_per_s"]),
            _n(refused),
            str(e["refused_total"]),
            _n(e["ttft_p99_s"]),
        )
    return Group(pools, ents)


def top(
    url: Annotated[str, typer.Option(help="a gateway replica's base URL")] = (
        "http://127.0.0.1:8000"
    ),
    admin_key: Annotated[
        str | None, typer.Option(help="an admin key; default $TOKENPOOLS_ADMIN_KEY")
    ] = None,
    interval: Annotated[float, typer.Option(help="seconds between redraws")] = 2.0,
    once: Annotated[bool, typer.Option(help="print one picture and exit")] = False,
) -> None:
    """Who is using the pool right now, who is refused and why: one gateway replica's view,
    redrawn until Ctrl-C."""
    key = admin_key or os.environ.get("TOKENPOOLS_ADMIN_KEY")
    if not key:
        fail("an admin key is needed: --admin-key or $TOKENPOOLS_ADMIN_KEY")
    if once:
        from rich.console import Console

        Console(width=160).print(render(fetch(url, key)))
        return
    with Live(render(fetch(url, key)), auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(fetch(url, key)), refresh=True)
        except KeyboardInterrupt:
            pass
