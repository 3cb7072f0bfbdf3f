"""A list-then-watch cache of one kind of object (client-go's informer pattern, on the
official client): list once (paged), then watch from the list's resourceVersion, resuming from
the last event or bookmark seen; list again when the server says that version is gone (410,
as a status or as an ERROR event). With `labels`, only objects that carry them: the server is
asked for those alone, and an event for one without them removes it from the cache. Runs in a
thread; `on_change` is called after each change.

`failing_since` is when the informer last stopped getting answers (None while it gets them),
so a host can report a cache that has gone stale instead of acting on it silently.

Attempts without progress back off (tokenpools/backoff.py): a failed list or watch, a 410 after the
first relist in a row, a watch that ends at once with nothing in it. `step` is one attempt and
its wait (injected), so the tests drive it without threads or sleeps."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from tokenpools.backoff import Backoff
from tokenpools.k8s.api import Kind, Kube, has_labels

log = logging.getLogger("tokenpools.k8s")
Key = tuple[str, str]  # namespace ("" when cluster-scoped), name


def key_of(obj: Any) -> Key:
    meta = obj["metadata"]
    return meta.get("namespace") or "", meta["name"]


class Informer:
    def __init__(
        self,
        kube: Kube,
        kind: Kind,
        namespace: str | None,
        on_change: Callable[[], None],
        watch_timeout_s: int = 60,
        clock: Callable[[], float] = time.monotonic,
        labels: Mapping[str, str] | None = None,
        backoff: Backoff | None = None,
        wait: Callable[[float], object] | None = None,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube, self.kind, self.namespace = kube, kind, namespace
        self.labels = dict(labels or {})  # only objects with these: asked of the server too
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.clock = clock
        self.failing_since: float | None = None
        self.lists = 0  # how many times it listed (a resumed watch does not list)
        self._objects: dict[Key, Any] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.backoff = backoff or Backoff()
        self._wait = wait or self._stopped.wait  # returns early when stopped
        self._timer = timer  # how long a watch lasted (the wall clock's business, not `clock`)
        self._version: str | None = None  # where the watch resumes; None: list first
        self._progress = 0  # events seen
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch-{kind.plural}")
        self.synced = threading.Event()  # the first list is in

    def items(self) -> list[Any]:
        with self._lock:
            return list(self._objects.values())

    def get(self, namespace: str, name: str) -> Any:
        """The cached object, or None ("" for a cluster-scoped object's namespace)."""
        with self._lock:
            return self._objects.get((namespace, name))

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self.step()

    def step(self) -> None:
        """One list, or one watch stream, then the wait the backoff asks for, if any."""
        try:
            if self._version is None:
                self._version = self._list()
                return
            started, seen = self._timer(), self._progress
            self._version = self._watch(self._version)
            if self._version is None:  # 410 Gone as an ERROR event: list again
                self._gone()
            elif self._progress == seen and self._timer() - started < self._short_s():
                self._pause()  # ended at once with nothing in it: no tight loop
            else:
                self.backoff.reset()
        except ApiException as exc:
            self._version = None
            if exc.status == 410:
                self._gone()
            else:
                self._failed()
        except Exception:  # the API server is away: try again later, keep the cache
            self._version = None
            self._failed()

    def _short_s(self) -> float:
        return min(1.0, self.watch_timeout_s / 2)

    def _gone(self) -> None:
        """The first relist after a 410 goes at once; another in a row waits its turn."""
        delay = self.backoff.next()
        if self.backoff.failures > 1:
            self._wait(delay)

    def _pause(self) -> None:
        self._wait(self.backoff.next())

    def _failed(self) -> None:
        if self._stopped.is_set():  # stopped mid-watch: the broken stream is ours to drop
            return
        log.warning("watching %s failed; retrying", self.kind.plural, exc_info=True)
        if self.failing_since is None:
            self.failing_since = self.clock()
        self._pause()

    def _list(self) -> str:
        items, version = self.kube.list_with_version(self.kind, self.namespace, self.labels)
        with self._lock:
            self._objects = {key_of(o): o for o in items}
        self.lists += 1
        self.failing_since = None
        self.synced.set()
        self.on_change()
        return version

    def _watch(self, version: str) -> str | None:
        """Follow one watch stream; the version to resume from, or None to list again."""
        stream = self.kube.watch(
            self.kind, self.namespace, version, self.watch_timeout_s, self.labels
        )
        for event in stream:
            self.failing_since = None
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":  # 410 Gone: the version is too old
                return None
            self._progress += 1
            self.backoff.reset()
            version = str(obj.get("metadata", {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            with self._lock:  # one that lost the labels is gone, whatever the server says
                if kind == "DELETED" or not has_labels(obj, self.labels):
                    self._objects.pop(key_of(obj), None)
                else:
                    self._objects[key_of(obj)] = obj
            self.on_change()
            if self._stopped.is_set():
                return None
        self.failing_since = None
        return version
