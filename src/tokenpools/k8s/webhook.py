"""The validating admission webhook: what CEL in the CRDs cannot say, refused before the API
server accepts it, with the checks the operator and the config loader apply.

- a TokenPool, TokenEntitlement or TokenBudget spec the config schema refuses (the same
  pydantic models);
- an entitlement whose pool does not exist, or is not open to its namespace;
- an entitlement with a key hash another entitlement already has.

`review` is pure over an AdmissionReview and a `Lookup`; the operator serves it over HTTPS
(k8s/operator_http.py) and looks objects up through the API server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pydantic import ValidationError

from tokenpools.k8s.api import ENTITLEMENTS, NAMESPACES, POOLS, Kube
from tokenpools.k8s.custom_resources import check_spec
from tokenpools.k8s.schema import PoolExtras


class Lookup(Protocol):
    def pool(self, name: str) -> Mapping[str, Any] | None: ...
    def namespace_labels(self, name: str) -> Mapping[str, str]: ...
    def entitlements(self) -> list[Mapping[str, Any]]: ...


class KubeLookup:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    def pool(self, name: str) -> Mapping[str, Any] | None:
        try:
            found: Mapping[str, Any] | None = self.kube.find(POOLS, None, name)
        except ValueError:  # not an object name: no pool has it
            return None
        return found

    def namespace_labels(self, name: str) -> Mapping[str, str]:
        ns = self.kube.find(NAMESPACES, None, name) or {}
        labels: Mapping[str, str] = ns.get("metadata", {}).get("labels") or {}
        return labels

    def entitlements(self) -> list[Mapping[str, Any]]:
        return self.kube.list(ENTITLEMENTS)


def review(body: Mapping[str, Any], lookup: Lookup) -> dict[str, Any]:
    request = body.get("request") or {}
    problem = None
    if request.get("operation") in ("CREATE", "UPDATE"):
        problem = _problem(request, lookup)
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
    if why is not None or kind != "TokenEntitlement":
        return why
    pool = lookup.pool(str(spec.get("pool")))
    if pool is None:
        return f"pool: no TokenPool {spec.get('pool')!r}"
    try:
        selector = PoolExtras.model_validate(
            {"namespaceSelector": (pool.get("spec") or {}).get("namespaceSelector")}
        ).namespaceSelector
    except ValidationError:  # a pool whose selector is malformed is open to no namespace
        selector = None
    if selector is None or not selector.matches(lookup.namespace_labels(ns)):
        return f"pool: TokenPool {spec.get('pool')!r} is not open to namespace {ns!r}"
    mine = set(spec.get("apiKeyHashes") or [])
    for other in lookup.entitlements():
        om = other["metadata"]
        if (om.get("namespace"), om["name"]) == (ns, name):
            continue
        shared = mine & set((other.get("spec") or {}).get("apiKeyHashes") or [])
        if shared:
            return (
                f"apiKeyHashes: {sorted(shared)[0][:15]}... is already used by another "
                "entitlement; a key maps to one entitlement"
            )
    return None
