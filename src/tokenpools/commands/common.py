"""What the commands share: errors on stderr with exit code 1, progress bars."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer
from rich.console import Console
from rich.progress import Progress, TaskID


def fail(message: str) -> NoReturn:
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code=1)


@contextmanager
def progress(total: float | None) -> Iterator[Callable[[str, float], None]]:
    """A progress bar in simulated seconds on a terminal; silence elsewhere."""
    if not sys.stderr.isatty():
        yield lambda label, t: None
        return
    with Progress(console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def advance(label: str, t: float) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=t)

        yield advance
