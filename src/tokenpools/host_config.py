"""Where a host beside a data plane (`tokenpools extproc`, `tokenpools authz`) gets its config
while it runs: a file, followed and re-read on SIGHUP; or, with a namespace, the cluster's
custom resources with that file beside them (k8s/following.py), as `tokenpools serve
--kubernetes` does. And how such a host waits to be stopped."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenpools.admission.config_file import ConfigFile, Reloadable, reload_from
from tokenpools.model.config import Config, load_config

if TYPE_CHECKING:
    from tokenpools.k8s.source import ClusterSource


def open_config(path: Path | None, namespace: str | None) -> tuple[Config, ClusterSource | None]:
    """The config to start on, and the cluster's source of it (None: the file alone)."""
    if namespace is None:
        assert path is not None
        return load_config(path), None
    from tokenpools.k8s.api import Kube, load_client
    from tokenpools.k8s.following import base_of
    from tokenpools.k8s.source import ClusterSource

    base = base_of(path)  # refused before the cluster is asked anything
    source = ClusterSource(Kube(load_client()), namespace, base).start()
    return source.config(), source


async def follow(host: Reloadable, path: Path | None, source: ClusterSource | None) -> None:
    """Adopt each change of the config's source: the cluster's objects and the file beside
    them, or the file alone (also re-read on SIGHUP). Runs until cancelled."""
    if source is not None:
        from tokenpools.k8s.following import follow_cluster

        await follow_cluster(source, host, path)
        return
    assert path is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload_from(host, path)))
    try:
        await ConfigFile(path).follow(host, 2.0)
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


async def run_until_stopped(
    host: Reloadable,
    path: Path | None,
    source: ClusterSource | None,
    stop: Callable[[], Awaitable[None]],
) -> None:
    """Follow the config's source until SIGTERM or SIGINT, then `stop` the host's servers and
    the source."""
    following = asyncio.create_task(follow(host, path, source))
    await until_stopped()
    following.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await following
    await stop()
    if source is not None:
        source.stop()


async def until_stopped() -> None:
    """Return at SIGTERM or SIGINT."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
