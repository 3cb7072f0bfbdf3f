"""`tokenpools usage`: the usage ledger in the terminal — read straight from its database
(the config's `usage.database`, or `--database`), grouped, as a table or CSV. A gateway need
not run; what the store has not flushed yet is not in it (`/admin/usage` flushes first)."""

from __future__ import annotations

import sys
import time
import zoneinfo
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tokenpools.commands.common import fail
from tokenpools.model.budgets import UsageSettings
from tokenpools.model.config import ConfigError, load_config
from tokenpools.usage.database import LedgerUnavailable, UsageDatabase
from tokenpools.usage.query import BadQuery, parse_query
from tokenpools.usage.report import group, to_csv

COLUMNS = ("requests", "input_tokens", "output_tokens", "cached_tokens", "cost")


def usage(
    config: Annotated[
        Path | None, typer.Option(help="the gateway's config: its usage section")
    ] = None,
    database: Annotated[str | None, typer.Option(help="sqlite:///path or postgresql://...")] = None,
    start: Annotated[str | None, typer.Option("--from", help="epoch seconds or ISO date")] = None,
    end: Annotated[str | None, typer.Option("--to", help="epoch seconds or ISO date")] = None,
    by: Annotated[
        str, typer.Option(help="tenant, entitlement, key, model (comma-separated)")
    ] = "tenant",
    per: Annotated[str, typer.Option(help="hour, day, month or all")] = "day",
    csv: Annotated[bool, typer.Option("--csv", help="CSV on stdout instead of a table")] = False,
    deployment: Annotated[
        str | None, typer.Option(help="whose rows (default: the config's usage.deployment)")
    ] = None,
) -> None:
    """Usage from the ledger: requests, tokens and cost, grouped."""
    settings = UsageSettings()
    if config is not None:
        try:
            settings = load_config(config).usage
        except ConfigError as exc:
            fail(str(exc))
    zone = zoneinfo.ZoneInfo(settings.time_zone)
    params = {"by": by, "per": per}
    params |= {k: v for k, v in (("from", start), ("to", end)) if v is not None}
    try:
        query = parse_query(params, zone, time.time())
    except BadQuery as exc:
        fail(str(exc))
    url = database or settings.database_url
    db = UsageDatabase(url, deployment or settings.deployment, settings.database_timeout_s)
    try:
        rows = group(db.read(query.start, query.end), query.by, query.per, zone)
    except LedgerUnavailable as exc:  # a file that cannot be opened, a server that is away
        fail(str(exc))
    finally:
        db.close()
    if csv:
        typer.echo(to_csv(rows), nl=False)
        return
    # Not a terminal: as wide as the table needs, so no number or name is ever cut.
    console = Console() if sys.stdout.isatty() else Console(width=1_000_000)
    console.print(_table(rows, query.by, query.per), crop=False)


def _table(rows: list[dict[str, Any]], by: tuple[str, ...], per: str) -> Table:
    table = Table(title=f"usage per {per}" if per != "all" else "usage")
    for column in (*(["period"] if per != "all" else []), *by, *COLUMNS, "refused"):
        left = column in (*by, "period")
        table.add_column(
            column, justify="left" if left else "right", no_wrap=True, min_width=len(column)
        )
    for row in rows:
        refused = sum(row["refusals"].values())
        cells = [*([row["period"]] if per != "all" else []), *(row[d] for d in by)]
        cells += [f"{row[c]:,}" if c != "cost" else row[c] for c in COLUMNS]
        table.add_row(*map(str, cells), f"{int(refused):,}")
    return table
