"""The operator's InferenceObjectives: each pool's five (k8s/inference_objectives.py) kept as
its applied spec says, in the platform's namespace, where the InferencePools are.

Once per pass the cluster is asked which group serves the kind and what tokenpools already
wrote there (one labelled list); then each pool creates what is missing and patches what
differs (an edited priority, another InferencePool, a recreated pool's uid), and objectives of
pools that are gone are deleted. Nothing is written when nothing changed, so the loop settles.

A cluster without the kind (no llm-d or Inference Extension CRDs) is not an error: there is
nothing to write, and the pools reconcile as before. An objective of the same name that
tokenpools did not make is never taken over; the pool reports it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from tokenpools.k8s.api import Conflict, Kind, Kube
from tokenpools.k8s.inference_objectives import (
    API_VERSIONS,
    MANAGED_BY,
    inference_objectives,
    objective_kind,
)
from tokenpools.k8s.names import label_value
from tokenpools.k8s.objects import POOL_LABEL
from tokenpools.k8s.schema import InferencePoolRef


class ObjectiveTaken(Exception):
    """An InferenceObjective of the name a pool needs exists and is not tokenpools'."""


@dataclass
class _Seen:
    api_version: str
    kind: Kind
    mine: dict[str, Any]  # name → the objective tokenpools wrote


class ObjectiveSync:
    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace
        self._seen: _Seen | Exception | None = None
        self._looked = False

    def begin(self) -> None:
        """A new pass: look at the cluster again when first needed."""
        self._seen, self._looked = None, False

    def _observe(self) -> _Seen | None:
        if not self._looked:
            self._looked = True
            try:
                self._seen = self._look()
            except Exception as exc:  # kept: every pool that needs it reports it
                self._seen = exc
        if isinstance(self._seen, Exception):
            raise self._seen
        return self._seen

    def _look(self) -> _Seen | None:
        for api_version in API_VERSIONS:
            kind = objective_kind(api_version)
            try:
                items = self.kube.list(kind, self.namespace, labels=MANAGED_BY)
            except ApiException as exc:
                if exc.status == 404:  # the group is not served here
                    continue
                raise
            return _Seen(api_version, kind, {i["metadata"]["name"]: i for i in items})
        return None

    def sync(self, pool: Mapping[str, Any], ref: InferencePoolRef | None) -> int:
        """Make the pool's objectives what its applied spec says; the number of writes."""
        seen = self._observe()
        if seen is None:
            return 0
        wanted = inference_objectives(
            pool["metadata"]["name"], self.namespace, ref, seen.api_version, owner=pool
        )
        writes, taken = 0, []
        for want in wanted:
            name = want["metadata"]["name"]
            have = seen.mine.get(name)
            if have is None:
                try:
                    seen.mine[name] = self.kube.create(seen.kind, self.namespace, want)
                except Conflict:
                    taken.append(name)  # the pool's other classes still get theirs
                    continue
                writes += 1
            elif _differs(have, want):
                patch = {"metadata": {k: want["metadata"][k] for k in ("labels",
                         "ownerReferences")}, "spec": want["spec"]}  # fmt: skip
                seen.mine[name] = self.kube.patch(seen.kind, self.namespace, name, patch)
                writes += 1
        if taken:
            raise ObjectiveTaken(
                f"InferenceObjective {', '.join(taken)} in {self.namespace} exists and is not "
                "tokenpools': delete it, or label it app.kubernetes.io/managed-by=tokenpools "
                "to hand it over"
            )
        return writes

    def forget(self, pools: set[str]) -> None:
        """Delete the objectives of pools that no longer exist (the garbage collector does the
        same through the owner reference; this does not wait for it)."""
        seen = self._observe()
        if seen is None:
            return
        live = {label_value(p) for p in pools}
        for name, obj in list(seen.mine.items()):
            if (obj["metadata"].get("labels") or {}).get(POOL_LABEL) not in live:
                self.kube.delete(seen.kind, self.namespace, name)
                del seen.mine[name]


def _differs(have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    meta = have["metadata"]
    labels = meta.get("labels") or {}
    return (
        have.get("spec") != want["spec"]
        or any(labels.get(k) != v for k, v in want["metadata"]["labels"].items())
        or meta.get("ownerReferences") != want["metadata"]["ownerReferences"]
    )
