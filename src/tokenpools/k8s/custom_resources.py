"""Custom resources ↔ the config file: one schema, two places.

`config_data` assembles the config document from the cluster's TokenPools (cluster-scoped),
TokenEntitlements (one namespace per tenant) and TokenBudgets (k8s/budget_objects.py), so the
gateway and the operator validate it with the very code a file goes through. A problem stays
with the object that has it: an invalid spec, an entitlement whose pool is unknown or not open
to its namespace, a key hash or a model name another object already has (the older object
keeps it) — the others go on. An object whose current spec is invalid keeps the last spec the
operator applied (`status.appliedSpec`, k8s/applied.py), so a typo never takes away what was
working.

`render` goes the other way: the CRs of an existing file, and each pool's llm-d
InferenceObjectives (k8s/inference_objectives.py).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from pydantic import ValidationError

from tokenpools.k8s.applied import (
    ClusterConfig,
    Where,
    age,
    held,
    in_force,
    live,
    meta_of,
    no_replaced,
)
from tokenpools.k8s.budget_objects import add_budgets, budget_objects, check_budget
from tokenpools.k8s.claims import Claims, kept_in_grace, model_taken, refused, served_models
from tokenpools.k8s.grace import Grace
from tokenpools.k8s.inference_objectives import LLM_D, inference_objectives
from tokenpools.k8s.names import entitlement_key
from tokenpools.k8s.schema import (
    API_VERSION,
    ENTITLEMENT_REPLACED,
    POOL_REPLACED,
    EntitlementExtras,
    ModelChoice,
    PoolExtras,
    split,
)
from tokenpools.model.config import format_errors
from tokenpools.model.config_schema import EntitlementSpec, PoolSpec
from tokenpools.model.keys import hash_key, is_key_hash


def config_data(
    pools: Sequence[Mapping[str, Any]],
    entitlements: Sequence[Mapping[str, Any]],
    namespaces: Mapping[str, Mapping[str, str]] | None = None,
    base: Mapping[str, Any] | None = None,
    applied_only: bool = False,
    budgets: Sequence[Mapping[str, Any]] = (),
    grace: Grace | None = None,
) -> ClusterConfig:
    """`namespaces` (name → labels) checks each pool's namespaceSelector (the operator); the
    gateway passes None and `applied_only`, taking each object as the operator applied it.
    `grace` keeps Bound entitlements their pool no longer admits for a while (k8s/grace.py).
    TokenBudgets join the base config's budgets."""
    out = ClusterConfig({**(base or {}), "pools": [], "entitlements": []})
    models = held(pools, lambda obj, spec: served_models(spec, obj["metadata"]["name"]))
    served: dict[str, str] = {}
    for obj in sorted(live(pools), key=age):
        name = obj["metadata"]["name"]
        where = ("TokenPool", "", name)
        refuse = partial(model_taken, name, served, models)
        got = in_force(obj, where, _pool, applied_only, out, refuse)
        if got is None:
            continue
        spec, extras = got
        served.update((m, name) for m in served_models(spec, name))
        out.pool_extras[name] = extras
        out.data["pools"].append(spec)
    holders = held(entitlements, lambda _, spec: spec.get("apiKeyHashes") or [])
    keys: dict[str, str] = {}
    for obj in sorted(live(entitlements), key=age):
        ns, name = meta_of(obj)
        where = ("TokenEntitlement", ns, name)
        claims = Claims(f"{ns}/{name}", ns, keys, holders)
        refuse = partial(refused, ns=ns, pools=out.pool_extras, namespaces=namespaces,
                         claims=claims)  # fmt: skip
        got = in_force(obj, where, _entitlement, applied_only, out, refuse)
        if got is None and grace is not None:
            got = kept_in_grace(obj, where, out, grace, _entitlement, refuse)
        if got is None:
            continue
        spec, _ = got
        keys.update((k, f"{ns}/{name}") for k in spec["apiKeys"])
        out.data["entitlements"].append(spec)
    add_budgets(out, budgets, applied_only)
    return out


def _pool(spec: Mapping[str, Any], where: Where) -> tuple[dict[str, Any], PoolExtras]:
    if isinstance(spec.get("model"), Mapping):  # stored before `customModel` (k8s/schema.py)
        spec = {**{k: v for k, v in spec.items() if k != "model"}, "customModel": spec["model"]}
    no_replaced(spec, POOL_REPLACED, PoolExtras)
    own, extra = split(spec, PoolExtras)
    extras = PoolExtras.model_validate(extra)
    model = ModelChoice(model=extras.model, customModel=extras.customModel).config_value()
    backends = [
        b.model_dump(exclude={"apiKeySecretRef"}, exclude_none=True) for b in extras.backends
    ]
    out = {**own, "name": where[2], "model": model, "backends": backends,
           "tokenizer": extras.tokenizer}  # fmt: skip
    PoolSpec.model_validate(out)
    return out, extras


def _entitlement(spec: Mapping[str, Any], where: Where) -> tuple[dict[str, Any], None]:
    no_replaced(spec, ENTITLEMENT_REPLACED, EntitlementExtras)
    own, extra = split(spec, EntitlementExtras)
    extras = EntitlementExtras.model_validate(extra)
    ns, name = where[1], where[2]
    out = {**own, "name": entitlement_key(ns, name), "tenantId": ns,
           "apiKeys": list(extras.apiKeyHashes)}  # fmt: skip
    EntitlementSpec.model_validate(out)
    return out, None


def check_spec(kind: str, spec: Mapping[str, Any], namespace: str, name: str) -> str | None:
    """What is wrong with one CR spec alone (the webhook's check), or None."""
    check = {"TokenPool": _pool, "TokenBudget": check_budget}.get(kind, _entitlement)
    try:
        check(spec, (kind, namespace, name))
    except ValidationError as exc:
        return format_errors(exc)
    return None


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def render(
    document: Mapping[str, Any],
    objectives_namespace: str | None = "tokenpools-system",
    objectives_api: str = LLM_D,
) -> list[dict[str, Any]]:
    """The TokenPools, TokenEntitlements and TokenBudgets for a config file's document. Each
    entitlement goes to the namespace named by its tenantId (in a cluster the namespace is the
    tenant); each pool is opened to the namespaces of its entitlements. Backend credentials
    and tokenizer files do not carry over: they become Secrets in the platform's namespace
    (docs). Then each pool's InferenceObjectives in `objectives_namespace` (the platform's,
    where its InferencePool is; None: none), for an InferencePool named as the pool."""
    objects: list[dict[str, Any]] = []
    ents = document.get("entitlements", [])
    for ent in ents:
        if not _DNS_LABEL.match(ent["tenantId"]):
            raise ValueError(
                f"entitlement {ent['name']!r}: tenantId {ent['tenantId']!r} is not a valid "
                "namespace name (lower-case letters, digits and '-', at most 63)"
            )
    for tenant in document.get("tenants", []):
        if not _DNS_LABEL.match(tenant["id"]):
            raise ValueError(
                f"tenant {tenant['id']!r} is not a valid namespace name (lower-case letters, "
                "digits and '-', at most 63): in a cluster a tenant is its namespace"
            )
    for pool in document.get("pools", []):
        spec = {k: v for k, v in pool.items() if k not in ("name", "backends", "tokenizer")}
        if isinstance(spec["model"], Mapping):  # a profile of its own (k8s/schema.py)
            spec["customModel"] = spec.pop("model")
        tenants = sorted({e["tenantId"] for e in ents if e["pool"] == pool["name"]})
        spec["namespaceSelector"] = {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": tenants}
        ]}  # fmt: skip
        spec["backends"] = [
            {k: v for k, v in b.items() if k in ("url", "timeoutS", "model")}
            for b in pool.get("backends", [])
        ]
        if pool.get("tokenizer") in ("estimate", "backend"):
            spec["tokenizer"] = pool["tokenizer"]
        objects.append(_cr("TokenPool", pool["name"], None, spec))
    for ent in ents:
        spec = {k: v for k, v in ent.items() if k not in ("name", "apiKeys", "tenantId")}
        keys = [k if is_key_hash(k) else hash_key(k) for k in ent.get("apiKeys", [])]
        if keys:
            spec["apiKeyHashes"] = keys
        objects.append(_cr("TokenEntitlement", ent["name"], ent["tenantId"], spec))
    objects += budget_objects(document.get("budgets", []), ents)
    if objectives_namespace is not None:
        for pool in document.get("pools", []):
            name = pool["name"]
            objects += inference_objectives(name, objectives_namespace, None, objectives_api)
    return objects


def secret_value(data: Mapping[str, str] | None, key: str) -> str | None:
    """A Secret's `data[key]`, decoded and stripped, or None when absent or empty."""
    if data is None or key not in data:
        return None
    return base64.b64decode(data[key]).decode().strip() or None


def _cr(kind: str, name: str, namespace: str | None, spec: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": meta, "spec": spec}
