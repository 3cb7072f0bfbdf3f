"""The validating admission webhook: what CEL in the CRDs cannot say, refused before the API
server accepts it, with the checks the operator and the config loader apply.

- a TokenPool, TokenEntitlement or TokenBudget spec the config schema refuses (the same
  pydantic models);
- an entitlement whose pool does not exist, or is not open to its namespace;
- an entitlement with a key hash another entitlement already has;
- a TokenPool edit that would unbind Bound entitlements (its namespaceSelector no longer
  matching their namespaces), named in the answer, unless the same edit acknowledges them; a
  pool that starts serving a model name another pool serves (k8s/revocations.py). An update is
  judged by what it changes, against the request's oldObject.

`review` is pure over an AdmissionReview and a `Lookup`; the operator serves it over HTTPS
(k8s/operator_http.py) and looks objects up in list-then-watch caches (k8s/webhook_cache.py),
so an admission reads memory and never lists the cluster."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from tokenpools.k8s.custom_resources import check_spec
from tokenpools.k8s.revocations import (
    acknowledged,
    model_served_elsewhere,
    selector_of,
    unbinding_refusal,
    unbound_by,
)


class Lookup(Protocol):
    def ready(self) -> bool: ...
    def pool(self, name: str) -> Mapping[str, Any] | None: ...
    def pools(self) -> list[Mapping[str, Any]]: ...
    def namespace_labels(self, name: str) -> Mapping[str, str]: ...
    def entitlements(self) -> list[Mapping[str, Any]]: ...
    def key_holders(self, key: str) -> list[tuple[str, str]]: ...


def review(body: Mapping[str, Any], lookup: Lookup) -> dict[str, Any]:
    request = body.get("request") or {}
    problem = None
    if request.get("operation") in ("CREATE", "UPDATE"):
        # a cache that has not listed yet would miss a conflict: refuse until it has
        ready = lookup.ready()
        problem = _problem(request, lookup) if ready else "the webhook is starting; try again"
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": problem is None}
    if problem is not None:
        response["status"] = {"code": 422, "reason": "Invalid", "message": problem}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def _problem(request: Mapping[str, Any], lookup: Lookup) -> str | None:
    obj = request.get("object") or {}
    kind = (request.get("kind") or {}).get("kind") or obj.get("kind")
    if kind not in ("TokenPool", "TokenEntitlement", "TokenBudget"):
        return None
    meta = obj.get("metadata") or {}
    ns, name = request.get("namespace") or "", meta.get("name") or request.get("name") or ""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return "spec: a mapping is required"
    why = check_spec(kind, spec, ns, name)
    if why is not None:
        return why
    if kind == "TokenPool":
        old = request.get("oldObject") if request.get("operation") == "UPDATE" else None
        return _pool_problem(name, obj, old if isinstance(old, Mapping) else None, lookup)
    if kind != "TokenEntitlement":
        return None
    pool = lookup.pool(str(spec.get("pool")))
    if pool is None:
        return f"pool: no TokenPool {spec.get('pool')!r}"
    selector = selector_of(pool.get("spec") or {})  # malformed: open to no namespace
    if selector is None or not selector.matches(lookup.namespace_labels(ns)):
        return f"pool: TokenPool {spec.get('pool')!r} is not open to namespace {ns!r}"
    for key in sorted(set(spec.get("apiKeyHashes") or [])):
        if any(holder != (ns, name) for holder in lookup.key_holders(key)):
            return (
                f"apiKeyHashes: {key[:15]}... is already used by another "
                "entitlement; a key maps to one entitlement"
            )
    return None


def _pool_problem(
    name: str, obj: Mapping[str, Any], old: Mapping[str, Any] | None, lookup: Lookup
) -> str | None:
    """A pool's create, or its update from `old` (judged by what the update changes)."""
    spec = obj["spec"]
    old_spec = (old.get("spec") or {}) if old is not None else None
    if old_spec is not None and not isinstance(old_spec, Mapping):
        old_spec = {}
    taken = model_served_elsewhere(name, spec, lookup.pools(), old_spec)
    if taken is not None:
        return taken
    affected = unbound_by(name, spec, lookup.entitlements(), lookup.namespace_labels, old_spec)
    annotations = (obj.get("metadata") or {}).get("annotations")
    old_annotations = ((old or {}).get("metadata") or {}).get("annotations")
    if affected and not acknowledged(annotations, affected, old_annotations):
        return unbinding_refusal(affected)
    return None
