"""CustomResourceDefinitions generated from the pydantic schema (`tokenpools k8s crds`).

deploy/crds/ holds the output; a test fails when it drifts from the schema. Kubernetes wants a
*structural* OpenAPI v3 schema: no $ref, `nullable` instead of a null branch, boolean
exclusive bounds, no additionalProperties next to properties (unknown fields are pruned).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tokenpools.k8s import cel_rules
from tokenpools.k8s.schema import (
    BUDGET_PLURAL,
    BUDGET_REPLACED,
    ENTITLEMENT_PLURAL,
    ENTITLEMENT_REPLACED,
    GROUP,
    POOL_PLURAL,
    POOL_REPLACED,
    VERSION,
    BudgetExtras,
    EntitlementExtras,
    PoolExtras,
)
from tokenpools.model.budgets_schema import BudgetSpec
from tokenpools.model.config_schema import EntitlementSpec, PoolSpec

_DROP = {"title", "default", "additionalProperties"}


def structural(node: Any, defs: dict[str, Any]) -> Any:
    """JSON Schema (pydantic) → a Kubernetes structural schema."""
    if isinstance(node, list):
        return [structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return structural({**defs[node["$ref"].split("/")[-1]], **_rest(node, "$ref")}, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        nullable = len(branches) < len(node["anyOf"])
        rest = {k: v for k, v in node.items() if k not in ("anyOf", *_DROP)}
        if len(branches) == 1:
            one = {**structural(branches[0], defs), **structural(rest, defs)}
        else:  # a value of several shapes (model: a name or a profile): checked by the operator
            one = {**structural(rest, defs), "x-kubernetes-preserve-unknown-fields": True}
        return {**one, "nullable": True} if nullable else one
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP and not (key == "additionalProperties" and "properties" not in node):
            continue
        if key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key in ("properties", "$defs"):
            out[key] = {k: structural(v, defs) for k, v in value.items()}
        else:
            out[key] = structural(value, defs)
    out.pop("$defs", None)
    if out.get("additionalProperties") is False:
        del out["additionalProperties"]
    return out


def _rest(node: dict[str, Any], *skip: str) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k not in skip}


def spec_schema(base: type[BaseModel], extras: type[BaseModel], drop: tuple[str, ...]) -> Any:
    schemas = [m.model_json_schema() for m in (base, extras)]
    defs = {k: v for s in schemas for k, v in s.get("$defs", {}).items()}
    own, extra = schemas  # the extras replace what `drop` names
    props = {k: v for k, v in own["properties"].items() if k not in drop} | extra["properties"]
    required = [r for s in schemas for r in s.get("required", []) if r not in drop]
    spec = {"type": "object", "properties": props, **({"required": required} if required else {})}
    return structural(spec, defs)


_CONDITION = {
    "type": "object",
    "required": ["type", "status"],
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"},
    },
}


def _status(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer"},
            "conditions": {
                "type": "array",
                "items": _CONDITION,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            **extra,
        },
    }


_INT = {"type": "integer"}
_STR = {"type": "string"}
_TIME = {"type": "string", "format": "date-time"}
# the spec the operator applied (checked by pydantic when it was applied)
_APPLIED = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
POOL_STATUS = _status(
    {
        "nodeName": _STR,
        "replicas": _INT,  # the replicas the node advertises (ready, held through a short dip)
        "readyReplicas": _INT,
        "shrinkPendingSince": _TIME,
        "desiredReplicas": _INT,
        "capacity": {"type": "object", "additionalProperties": _INT},
        "lastScaleTime": _TIME,
        "appliedSpec": _APPLIED,
        "message": _STR,
    }
)
ENTITLEMENT_STATUS = _status(
    {
        "state": {"type": "string", "enum": ["Pending", "Bound", "Degraded", "Expired", "Invalid"]},
        "podName": _STR,
        "nodeName": _STR,
        "requests": {"type": "object", "additionalProperties": _INT},
        "appliedSpec": _APPLIED,
        "message": _STR,
    }
)


BUDGET_STATUS = _status({"appliedSpec": _APPLIED, "message": _STR})


def _crd(
    kind: str,
    plural: str,
    short: str,
    spec: Any,
    status: Any,
    columns: list[Any],
    scope: str = "Namespaced",
    subresources: dict[str, Any] | None = None,
) -> Any:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short],
                "categories": ["tokenpools"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": subresources or {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": _STR,
                                "kind": _STR,
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def _col(name: str, path: str, kind: str = "string") -> dict[str, str]:
    return {"name": name, "type": kind, "jsonPath": path}


def crds() -> list[Any]:
    """The CRDs from the config schema: TokenPool (cluster-scoped, the platform's, with a
    scale subresource for HPA or KEDA), TokenEntitlement (namespaced, the tenant's) and
    TokenBudget (cluster-scoped, the platform's)."""
    ready = '.status.conditions[?(@.type=="Ready")].status'
    pool_spec = spec_schema(PoolSpec, PoolExtras, POOL_REPLACED)
    cel_rules.attach(pool_spec, cel_rules.POOL_SPEC, cel_rules.POOL_FIELDS)
    ent_spec = spec_schema(EntitlementSpec, EntitlementExtras, ENTITLEMENT_REPLACED)
    cel_rules.attach(ent_spec, cel_rules.ENTITLEMENT_SPEC, cel_rules.ENTITLEMENT_FIELDS)
    scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}
    pool = _crd(
        "TokenPool",
        POOL_PLURAL,
        "tpool",
        pool_spec,
        POOL_STATUS,
        [
            _col("Node", ".status.nodeName"),
            _col("Replicas", ".status.replicas", "integer"),
            _col("Desired", ".status.desiredReplicas", "integer"),
            _col("Ready", ready),
            _col("Age", ".metadata.creationTimestamp", "date"),
        ],
        scope="Cluster",
        subresources={"status": {}, "scale": scale},
    )
    ent = _crd(
        "TokenEntitlement",
        ENTITLEMENT_PLURAL,
        "tent",
        ent_spec,
        ENTITLEMENT_STATUS,
        [
            _col("Pool", ".spec.pool"),
            _col("Class", ".spec.serviceClass"),
            _col("State", ".status.state"),
            _col("Age", ".metadata.creationTimestamp", "date"),
        ],
    )
    budget = _crd(
        "TokenBudget",
        BUDGET_PLURAL,
        "tbudget",
        spec_schema(BudgetSpec, BudgetExtras, BUDGET_REPLACED),
        BUDGET_STATUS,
        [
            _col("Tenant", ".spec.tenant"),
            _col("Entitlement", ".spec.entitlement"),
            _col("Key", ".spec.key"),
            _col("Window", ".spec.window"),
            _col("Ready", ready),
            _col("Age", ".metadata.creationTimestamp", "date"),
        ],
        scope="Cluster",
    )
    return [pool, ent, budget]
