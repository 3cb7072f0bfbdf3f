"""A list-then-watch cache of one kind of object in one namespace (client-go's informer
pattern, on the official client): list once, then watch from the list's resourceVersion,
resuming from the last event seen; list again when the server says the version is gone.
Runs in a thread; `on_change` is called after each change to the cache."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from tokenpools.k8s.api import Kind, Kube

log = logging.getLogger("tokenpools.k8s")


class Informer:
    def __init__(
        self,
        kube: Kube,
        kind: Kind,
        namespace: str,
        on_change: Callable[[], None],
        watch_timeout_s: int = 60,
    ) -> None:
        self.kube, self.kind, self.namespace = kube, kind, namespace
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self._objects: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch-{kind.plural}")
        self.synced = threading.Event()  # the first list is in

    def items(self) -> list[Any]:
        with self._lock:
            return list(self._objects.values())

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                version: str | None = self._list()
                while not self._stopped.is_set() and version is not None:
                    version = self._watch(version)
            except Exception:  # the API server is away: try again shortly, keep the cache
                log.warning("watching %s failed; retrying", self.kind.plural, exc_info=True)
                self._stopped.wait(1.0)

    def _list(self) -> str:
        listing = self.kube.request("GET", self.kind.path(self.namespace))
        with self._lock:
            self._objects = {o["metadata"]["name"]: o for o in listing["items"]}
        self.synced.set()
        self.on_change()
        return str(listing["metadata"].get("resourceVersion") or "")

    def _watch(self, version: str) -> str | None:
        """Follow one watch stream; the version to resume from, or None to list again."""
        for event in self.kube.watch(self.kind, self.namespace, version, self.watch_timeout_s):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":  # 410 Gone: the version is too old
                return None
            version = str(obj.get("metadata", {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            name = obj["metadata"]["name"]
            with self._lock:
                if kind == "DELETED":
                    self._objects.pop(name, None)
                else:
                    self._objects[name] = obj
            self.on_change()
            if self._stopped.is_set():
                return None
        return version
