"""The webhook's view of the cluster: list-then-watch caches (k8s/informer.py) of TokenPools,
TokenEntitlements and namespaces, so an admission reads memory and never lists the cluster
(the webhook answers within the API server's timeout however many entitlements there are), and
an index of key hashes, rebuilt only after the entitlements changed. Until every cache has
listed once the webhook refuses (`ready`): a cache that has not listed would miss a conflict."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from tokenpools.k8s.api import ENTITLEMENTS, NAMESPACES, POOLS, Kube
from tokenpools.k8s.informer import Informer

READY_WAIT_S = 2.0  # of the API server's 5 s webhook timeout (deploy/webhook)


class CachedLookup:
    def __init__(self, kube: Kube, clock: Callable[[], float] = time.monotonic) -> None:
        self._changes = 0  # entitlement changes seen, to know when the key index is stale
        self._indexed = -1
        self._index: dict[str, list[tuple[str, str]]] = {}
        self._lock = threading.Lock()
        self._pools = Informer(kube, POOLS, None, lambda: None, clock=clock)
        self._ents = Informer(kube, ENTITLEMENTS, None, self._changed, clock=clock)
        self._namespaces = Informer(kube, NAMESPACES, None, lambda: None, clock=clock)
        self._all = (self._pools, self._ents, self._namespaces)

    def start(self) -> CachedLookup:
        for informer in self._all:
            informer.start()
        return self

    def stop(self) -> None:
        for informer in self._all:
            informer.stop()

    def ready(self) -> bool:
        deadline = time.monotonic() + READY_WAIT_S
        return all(i.synced.wait(max(0.0, deadline - time.monotonic())) for i in self._all)

    def _changed(self) -> None:
        with self._lock:
            self._changes += 1

    def pool(self, name: str) -> Mapping[str, Any] | None:
        found: Mapping[str, Any] | None = self._pools.get("", name)
        return found

    def pools(self) -> list[Mapping[str, Any]]:
        return self._pools.items()

    def namespace_labels(self, name: str) -> Mapping[str, str]:
        ns = self._namespaces.get("", name) or {}
        labels: Mapping[str, str] = ns.get("metadata", {}).get("labels") or {}
        return labels

    def entitlements(self) -> list[Mapping[str, Any]]:
        return self._ents.items()

    def key_holders(self, key: str) -> list[tuple[str, str]]:
        """(namespace, name) of the entitlements whose spec, or applied spec, has `key`."""
        with self._lock:
            changes = self._changes
            if changes != self._indexed:
                self._index = _index(self._ents.items())
                self._indexed = changes
            return list(self._index.get(key, []))


def _index(entitlements: list[Any]) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for ent in entitlements:
        meta = ent["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        who = (meta.get("namespace") or "", meta["name"])
        for spec in (ent.get("spec"), (ent.get("status") or {}).get("appliedSpec")):
            keys = spec.get("apiKeyHashes") if isinstance(spec, Mapping) else None
            for key in keys if isinstance(keys, list) else []:
                if who not in out[key]:
                    out[key].append(who)
    return dict(out)
