"""The cluster as the gateway's config source (`tokenpools serve --kubernetes`).

Every TokenPool (cluster-scoped), every TokenEntitlement (one namespace per tenant), every
TokenBudget (cluster-scoped) and the Secrets of the platform's namespace only (backend
credentials) become one Config. Each object
is taken as the operator applied it (`status.appliedSpec`) with the binding the operator wrote
with it, so an edit the operator has not looked at yet, or has refused, changes nothing here:
an entitlement edited to a bigger class is not admitted under the new spec before kube-scheduler
has bound it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from tokenpools.k8s.api import BUDGETS, ENTITLEMENTS, POOLS, SECRETS, Kube
from tokenpools.k8s.custom_resources import config_data, secret_value
from tokenpools.k8s.informer import Informer
from tokenpools.k8s.names import entitlement_key
from tokenpools.model.config import Config, ConfigError, parse_config
from tokenpools.model.entitlement import BindingState

_STATES = {s.value: s for s in BindingState}
STALE_AFTER_S = 30.0


class ClusterSource:
    """Four Informers (list, then watch); `config()` builds the gateway's Config from what they
    hold, and `on_change` is called (from a watch thread) whenever any of them changes."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        base: Mapping[str, Any],
        clock: Callable[[], float] = time.monotonic,
        watch_timeout_s: int = 60,
    ) -> None:
        self.namespace, self.base, self.clock = namespace, base, clock
        self.on_change: Callable[[], None] = lambda: None
        self._informers = [
            Informer(kube, kind, ns, self._changed, watch_timeout_s, clock)
            for kind, ns in (
                (POOLS, None),
                (ENTITLEMENTS, None),
                (SECRETS, namespace),
                (BUDGETS, None),
            )
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

    def stale(self) -> list[str]:
        """The watches that have had no answer for STALE_AFTER_S (for /readyz)."""
        now = self.clock()
        return [
            f"the watch of {i.kind.plural} has had no answer for {now - i.failing_since:.0f} s"
            for i in self._informers
            if i.failing_since is not None and now - i.failing_since >= STALE_AFTER_S
        ]

    def config(self) -> Config:
        pools, ents, secrets, budgets = (i.items() for i in self._informers)
        data = {s["metadata"]["name"]: s.get("data") or {} for s in secrets}
        return cluster_config(pools, ents, data, self.base, budgets)


def cluster_config(
    pools: list[Any],
    ents: list[Any],
    secrets: Mapping[str, Mapping[str, str]],
    base: Mapping[str, Any] | None = None,
    budgets: Sequence[Any] = (),
) -> Config:
    """The Config of what the operator applied. Raises ConfigError when a backend's Secret is
    missing (the running config is kept); objects the operator refused are left out."""
    cluster = config_data(pools, ents, base=base, applied_only=True, budgets=budgets)
    config = parse_config(cluster.data)
    pools_out = {}
    for name, pool in config.pools.items():
        refs = [b.apiKeySecretRef for b in cluster.pool_extras[name].backends]
        backends = []
        for backend, ref in zip(pool.backends, refs, strict=True):
            if ref is not None:
                key = secret_value(secrets.get(ref.name), ref.key)
                if key is None:
                    raise ConfigError(
                        f"TokenPool {name}: backend {backend.url}: Secret {ref.name!r} has no "
                        f"key {ref.key!r} in the gateway's namespace"
                    )
                backend = replace(backend, api_key=key)
            backends.append(backend)
        pools_out[name] = replace(pool, backends=tuple(backends))
    bindings = {}
    for e in ents:
        meta, status = e["metadata"], e.get("status") or {}
        state = _STATES.get(status.get("state", ""), BindingState.PENDING)
        bindings[entitlement_key(meta.get("namespace") or "", meta["name"])] = state
    return replace(config, pools=pools_out, bindings=bindings)
