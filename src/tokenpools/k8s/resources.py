"""Custom resources ↔ the config file: one schema, two places.

`config_data` assembles the config document from the cluster's TokenPools, TokenEntitlements
and the Secrets they name, so the gateway and the operator validate it with the very code a
file goes through. `render` goes the other way: the CRs and Secrets of an existing file.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tokenpools.k8s.schema import (
    API_VERSION,
    EntitlementExtras,
    PoolExtras,
    SecretKeyRef,
    split,
)
from tokenpools.model.config import format_errors
from tokenpools.model.config_schema import EntitlementSpec, PoolSpec
from tokenpools.model.keys import hash_key, is_key_hash

ExtrasT = TypeVar("ExtrasT", bound=BaseModel)


@dataclass
class ClusterConfig:
    """The config document built from the cluster, and each object it had to leave out."""

    data: dict[str, Any]
    invalid: dict[tuple[str, str, str], str] = field(default_factory=dict)  # kind, ns, name
    pool_extras: dict[str, PoolExtras] = field(default_factory=dict)


def _meta(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata", {})
    return meta.get("namespace") or "default", meta["name"]


def secret_keys(data: Mapping[str, str] | None, key: str) -> list[str] | None:
    """The key hashes in a Secret's `data[key]` (base64, one key or hash per line)."""
    if data is None or key not in data:
        return None
    text = base64.b64decode(data[key]).decode()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [line if is_key_hash(line) else hash_key(line) for line in lines]


def config_data(
    pools: list[Mapping[str, Any]],
    entitlements: list[Mapping[str, Any]],
    secrets: Mapping[tuple[str, str], Mapping[str, str]] | None,
    base: Mapping[str, Any] | None = None,
) -> ClusterConfig:
    """Pools and entitlements of one namespace (pool names are the CRs' names) → config.
    With `secrets` None (the operator, which needs no keys) Secrets are not read."""
    out = ClusterConfig({**(base or {}), "pools": [], "entitlements": []})
    for obj in _live(pools):
        pool = _checked(obj, "TokenPool", PoolSpec, PoolExtras, out)
        if pool is not None:
            out.pool_extras[pool[0]["name"]] = pool[1]
            out.data["pools"].append(pool[0])
    known = {p["name"] for p in out.data["pools"]}
    for obj in _live(entitlements):
        ent = _checked(obj, "TokenEntitlement", EntitlementSpec, EntitlementExtras, out)
        if ent is None:
            continue
        spec, extras = ent
        where = ("TokenEntitlement", *_meta(obj))
        if spec.get("pool") not in known:
            out.invalid[where] = f"pool: unknown pool {spec.get('pool')!r}"
            continue
        keys = [] if secrets is None else _keys(extras.apiKeySecretRefs, secrets, where[1])
        if isinstance(keys, str):
            out.invalid[where] = keys
        else:
            out.data["entitlements"].append({**spec, "apiKeys": keys})
    return out


def _keys(
    refs: list[SecretKeyRef], secrets: Mapping[tuple[str, str], Mapping[str, str]], ns: str
) -> list[str] | str:
    """The key hashes the refs name, or what is missing."""
    keys: list[str] = []
    for ref in refs:
        found = secret_keys(secrets.get((ns, ref.name)), ref.key)
        if found is None:
            return f"apiKeySecretRefs: Secret {ref.name!r} has no key {ref.key!r}"
        keys += found
    return keys


def _live(objects: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [o for o in objects if not o["metadata"].get("deletionTimestamp")]


def _checked(
    obj: Mapping[str, Any],
    kind: str,
    model: type[BaseModel],
    extras_model: type[ExtrasT],
    out: ClusterConfig,
) -> tuple[dict[str, Any], ExtrasT] | None:
    """(the file-schema spec with its name, the cluster-only fields), or None with the
    problem recorded in `out.invalid`."""
    ns, name = _meta(obj)
    own, extra = split(dict(obj.get("spec") or {}), extras_model)
    spec = {**own, "name": name}
    try:
        model.model_validate(spec)
        return spec, extras_model.model_validate(extra)
    except ValidationError as exc:
        out.invalid[(kind, ns, name)] = format_errors(exc)
        return None


def render(document: Mapping[str, Any], namespace: str) -> list[dict[str, Any]]:
    """The TokenPools, TokenEntitlements and Secrets for a config file's document."""
    objects: list[dict[str, Any]] = []
    for pool in document.get("pools", []):
        spec = {k: v for k, v in pool.items() if k != "name"}
        objects.append(_cr("TokenPool", pool["name"], namespace, spec))
    for ent in document.get("entitlements", []):
        spec = {k: v for k, v in ent.items() if k not in ("name", "apiKeys")}
        if ent.get("apiKeys"):
            secret = f"{ent['name']}-api-keys"
            text = "\n".join(ent["apiKeys"]) + "\n"
            objects.append(
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": secret, "namespace": namespace},
                    "type": "Opaque",
                    "data": {"apiKeys": base64.b64encode(text.encode()).decode()},
                }
            )
            spec["apiKeySecretRefs"] = [{"name": secret, "key": "apiKeys"}]
        objects.append(_cr("TokenEntitlement", ent["name"], namespace, spec))
    return objects


def _cr(kind: str, name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": name, "namespace": namespace}
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": meta, "spec": spec}
