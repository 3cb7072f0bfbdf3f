"""The cluster as the gateway's config source (`tokenpools serve --kubernetes`).

Pools, entitlements and the key Secrets of one namespace become one Config, validated as a
file is; each entitlement's binding is the state the operator wrote from its lease pod, so the
gateway honours kube-scheduler's decision (an entitlement without one is Pending)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from tokenpools.k8s.api import ENTITLEMENTS, POOLS, SECRETS, Kube
from tokenpools.k8s.informer import Informer
from tokenpools.k8s.resources import config_data
from tokenpools.model.config import Config, parse_config
from tokenpools.model.entitlement import BindingState

_STATES = {s.value: s for s in BindingState}


class ClusterSource:
    """The namespace's TokenPools, TokenEntitlements and Secrets, each kept by an Informer
    (list, then watch); `config()` builds the gateway's Config from what they hold, and
    `on_change` is called (from a watch thread) whenever any of them changes."""

    def __init__(self, kube: Kube, namespace: str, base: Mapping[str, Any]) -> None:
        self.namespace, self.base = namespace, base
        self.on_change: Callable[[], None] = lambda: None
        self._informers = [
            Informer(kube, kind, namespace, self._changed)
            for kind in (POOLS, ENTITLEMENTS, SECRETS)
        ]

    def _changed(self) -> None:
        self.on_change()

    def start(self, timeout_s: float = 30.0) -> ClusterSource:
        for informer in self._informers:
            informer.start()
        for informer in self._informers:
            if not informer.synced.wait(timeout_s):
                raise TimeoutError(f"no list of {informer.kind.plural} in {timeout_s:g} s")
        return self

    def stop(self) -> None:
        for informer in self._informers:
            informer.stop()

    def config(self) -> Config:
        pools, ents, secrets = (i.items() for i in self._informers)
        data = {(self.namespace, s["metadata"]["name"]): s.get("data") or {} for s in secrets}
        return cluster_config(pools, ents, data, self.base)


def cluster_config(
    pools: list[Any],
    ents: list[Any],
    secrets: Mapping[tuple[str, str], Any],
    base: Mapping[str, Any] | None = None,
) -> Config:
    """Raises ConfigError when the objects together are invalid (e.g. a key used twice);
    objects invalid alone are left out, as the operator reports them Invalid."""
    cluster = config_data(pools, ents, secrets, base)
    config = parse_config(cluster.data)
    bindings = {
        e["metadata"]["name"]: _STATES.get(
            (e.get("status") or {}).get("state", ""), BindingState.PENDING
        )
        for e in ents
    }
    return replace(config, bindings=bindings)
