"""The cluster as the gateway's config source (`tokenpools serve --kubernetes`).

Every TokenPool (cluster-scoped), every TokenEntitlement (one namespace per tenant), every
TokenBudget (cluster-scoped) and the backend-key Secrets of the platform's namespace become one
Config. Each object is taken as the operator applied it (`status.appliedSpec`) with the binding
the operator wrote with it, so an edit the operator has not looked at yet, or has refused,
changes nothing here: an entitlement edited to a bigger class is not admitted under the new spec
before kube-scheduler has bound it.

Backend keys: only Secrets labelled `tokenpools.io/backend-key=true` (the platform sets it) are
listed and watched, by a label selector, so a pool writer who names any other Secret of the
namespace in `apiKeySecretRef` (the webhook's TLS key, the Redis password) never has its data
read, let alone sent to the pool's URL: the config is refused, the running one kept, and the
pool gets a Warning Event (`BackendKeyRefused`) naming the Secret."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from tokenpools.k8s import objects as o
from tokenpools.k8s.api import BUDGETS, ENTITLEMENTS, EVENTS, POOLS, SECRETS, Kube, has_labels
from tokenpools.k8s.custom_resources import config_data, secret_value
from tokenpools.k8s.informer import Informer
from tokenpools.k8s.names import entitlement_key
from tokenpools.model.config import Config, ConfigError, parse_config
from tokenpools.model.entitlement import BindingState

log = logging.getLogger("tokenpools.k8s")
_STATES = {s.value: s for s in BindingState}
STALE_AFTER_S = 30.0
BACKEND_KEYS = {o.BACKEND_KEY_LABEL: "true"}


class BackendKeyRefused(ConfigError):
    """A pool's backend key names no backend-key Secret (missing, or not labelled so)."""

    def __init__(self, refused: Mapping[str, str]) -> None:
        super().__init__("\n".join(refused.values()))
        self.refused = dict(refused)  # pool name → why


def _in_thread(step: Callable[[], None]) -> None:
    threading.Thread(target=step, daemon=True, name="backend-key-events").start()


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
        wall_clock: Callable[[], float] = time.time,
        background: Callable[[Callable[[], None]], None] = _in_thread,
    ) -> None:
        self.kube, self.namespace, self.base, self.clock = kube, namespace, base, clock
        self.wall_clock, self.background = wall_clock, background  # Events, off the caller
        self.on_change: Callable[[], None] = lambda: None
        self._reported: set[tuple[str, str]] = set()  # (pool uid, why) already an Event
        self._informers = [
            Informer(kube, kind, ns, self._changed, watch_timeout_s, clock, labels)
            for kind, ns, labels in (
                (POOLS, None, None),
                (ENTITLEMENTS, None, None),
                (SECRETS, namespace, BACKEND_KEYS),  # no other Secret is even listed
                (BUDGETS, None, None),
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
        try:
            config = cluster_config(pools, ents, secrets, self.base, budgets, self.namespace)
        except BackendKeyRefused as exc:
            self._report(pools, exc.refused)
            raise
        self._report(pools, {})
        return config

    def _report(self, pools: list[Any], refused: Mapping[str, str]) -> None:
        """A Warning Event on each pool whose backend key is refused, once per cause; a cause
        that goes and comes back is reported again."""
        now = {(p["metadata"].get("uid", ""), refused[p["metadata"]["name"]]): p
               for p in pools if p["metadata"]["name"] in refused}  # fmt: skip
        for (_, why), pool in now.items():
            if (pool["metadata"].get("uid", ""), why) not in self._reported:
                event = o.event(pool, "BackendKeyRefused", why, self.wall_clock(), "Warning")
                self.background(functools.partial(self._post, event))
        self._reported = set(now)

    def _post(self, event: Mapping[str, Any]) -> None:
        try:
            self.kube.create(EVENTS, self.namespace, event)
        except Exception:  # best-effort: the gateway's log has it too
            log.warning("could not post an Event: %s", event["message"], exc_info=True)


def cluster_config(
    pools: list[Any],
    ents: list[Any],
    secrets: Sequence[Mapping[str, Any]],
    base: Mapping[str, Any] | None = None,
    budgets: Sequence[Any] = (),
    namespace: str = "the gateway's namespace",
) -> Config:
    """The Config of what the operator applied; objects the operator refused are left out.
    Backend keys come from `secrets` labelled as backend keys only (the others are never
    read); raises BackendKeyRefused (the running config is kept) when a pool's named Secret is
    not one of them, or lacks the key."""
    cluster = config_data(pools, ents, base=base, applied_only=True, budgets=budgets)
    config = parse_config(cluster.data)
    keys = {
        s["metadata"]["name"]: s.get("data") or {} for s in secrets if has_labels(s, BACKEND_KEYS)
    }
    pools_out, refused = {}, {}
    for name, pool in config.pools.items():
        refs = [b.apiKeySecretRef for b in cluster.pool_extras[name].backends]
        backends = []
        for backend, ref in zip(pool.backends, refs, strict=True):
            if ref is not None:
                if ref.name not in keys:
                    refused[name] = (
                        f"TokenPool {name}: backend {backend.url}: Secret {ref.name!r} is not a "
                        f"backend key: no Secret of that name labelled {o.BACKEND_KEY_LABEL}=true "
                        f"in {namespace}, and no other Secret is read"
                    )
                    break
                key = secret_value(keys[ref.name], ref.key)
                if key is None:
                    refused[name] = (
                        f"TokenPool {name}: backend {backend.url}: Secret {ref.name!r} has no "
                        f"key {ref.key!r}"
                    )
                    break
                backend = replace(backend, api_key=key)
            backends.append(backend)
        pools_out[name] = replace(pool, backends=tuple(backends))
    if refused:
        raise BackendKeyRefused(refused)
    bindings = {}
    for e in ents:
        meta, status = e["metadata"], e.get("status") or {}
        state = _STATES.get(status.get("state", ""), BindingState.PENDING)
        bindings[entitlement_key(meta.get("namespace") or "", meta["name"])] = state
    return replace(config, pools=pools_out, bindings=bindings)
