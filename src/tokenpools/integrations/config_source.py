"""Where the LiteLLM hook's config comes from, named by LiteLLM's environment: a file
(`TOKENPOOLS_CONFIG`), or, in a cluster (`TOKENPOOLS_KUBERNETES_NAMESPACE`: the platform's
namespace), the cluster's custom resources with that file, if any, beside them, by the same
rule and with the same watches as `tokenpools serve --kubernetes` (k8s/following.py). Either
is followed while LiteLLM runs."""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from tokenpools.admission.config_file import ConfigFile, Reloadable
from tokenpools.model.config import Config, load_config

CONFIG_ENV = "TOKENPOOLS_CONFIG"
NAMESPACE_ENV = "TOKENPOOLS_KUBERNETES_NAMESPACE"
Follow = Callable[[Reloadable], Coroutine[Any, Any, None]]


def config_source(
    path: str | Path | None, interval_s: float, environ: Mapping[str, str] = os.environ
) -> tuple[Config, Follow]:
    """The config now, and how to follow it (a coroutine function, run until cancelled)."""
    path = path or environ.get(CONFIG_ENV) or None
    namespace = environ.get(NAMESPACE_ENV)
    if namespace:
        return _from_the_cluster(namespace, None if path is None else Path(path), interval_s)
    if path is None:
        raise RuntimeError(
            f"tokenpools: set {CONFIG_ENV} to the tokenpools config file, or "
            f"{NAMESPACE_ENV} to read the cluster's custom resources"
        )
    config_file = ConfigFile(Path(path))
    config = load_config(Path(path))

    async def follow(host: Reloadable) -> None:
        await config_file.follow(host, interval_s)

    return config, follow


def _from_the_cluster(
    namespace: str, path: Path | None, interval_s: float
) -> tuple[Config, Follow]:
    from tokenpools.k8s.api import Kube, load_client
    from tokenpools.k8s.following import base_of, follow_cluster
    from tokenpools.k8s.source import ClusterSource

    base = base_of(path)
    source = ClusterSource(Kube(load_client()), namespace, base).start()

    async def follow(host: Reloadable) -> None:
        try:
            await follow_cluster(source, host, path, interval_s)
        finally:
            source.stop()

    return source.config(), follow
