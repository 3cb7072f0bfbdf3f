"""The cluster as a followed config, for every host that admits (`tokenpools serve
--kubernetes`, `tokenpools extproc --kubernetes`): one rule for a file beside the cluster, and
one loop that adopts each change as a config reload is.

The rule: TokenPools and TokenEntitlements come only from the cluster (as the operator applied
them); a file given beside it supplies everything else (`policy`, `gateway`, `state`, `usage`,
`tenants`, `budgets`; its budgets apply with the cluster's TokenBudgets). A file that lists
pools or entitlements is refused rather than half-read: which source wins is never a guess."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tokenpools.admission.config_file import ConfigFile, Reloadable
from tokenpools.k8s.source import ClusterSource
from tokenpools.model.config import ConfigError

log = logging.getLogger("tokenpools.k8s")
FROM_THE_CLUSTER = ("pools", "entitlements")


def base_of(path: Path | None) -> dict[str, Any]:
    """What a file beside the cluster contributes; refuses one that names what only the
    cluster may (ConfigError naming the file and the keys)."""
    if path is None:
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top, got {type(data).__name__}")
    taken = [k for k in FROM_THE_CLUSTER if k in data]
    if taken:
        raise ConfigError(
            f"{path}: {' and '.join(taken)} come from the cluster with --kubernetes "
            "(TokenPools and TokenEntitlements); remove them from the file"
        )
    return data


async def follow_cluster(
    source: ClusterSource,
    host: Reloadable,
    path: Path | None = None,
    interval_s: float = 2.0,
    on_adopted: Callable[[], None] = lambda: None,
) -> None:
    """Adopt the cluster's config into `host` whenever a watch sees a change or the file
    beside it changes; an invalid set is logged and the running config kept. Runs until
    cancelled; `on_adopted` is told after each successful reload (tests wait on it)."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def changed() -> None:  # called from a watch thread
        loop.call_soon_threadsafe(wake.set)

    source.on_change = changed
    watching = None
    if path is not None:
        watching = asyncio.create_task(_watch_file(source, path, wake, interval_s))
    wake.set()  # changes between the first list and now
    try:
        while True:
            await wake.wait()
            wake.clear()
            try:
                await host.reload(source.config())
            except ConfigError as exc:
                log.error("cluster config rejected, keeping the running config: %s", exc)
                continue
            on_adopted()
    finally:
        if watching is not None:
            watching.cancel()


async def _watch_file(
    source: ClusterSource, path: Path, wake: asyncio.Event, interval_s: float
) -> None:
    config_file = ConfigFile(path)
    while True:
        await asyncio.sleep(interval_s)
        if not config_file.changed():
            continue
        try:
            source.base = base_of(path)
        except ConfigError as exc:
            log.error("config file rejected, keeping the running config: %s", exc)
            continue
        wake.set()
