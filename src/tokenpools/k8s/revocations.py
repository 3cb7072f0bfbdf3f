"""What a TokenPool edit would take from tenants, for the validating webhook (pure).

A platform edit must never revoke a tenant silently. Of the edits that could:
- a `namespaceSelector` that no longer matches the namespace of an entitlement that is Bound to
  the pool: refused, naming every such entitlement, unless the pool acknowledges exactly those
  (the annotation below, or `*`); acknowledged or not, the operator still keeps each binding for
  its grace period (k8s/grace.py), so an edit that got through (no webhook) can be undone;
- a served model name another pool serves: refused (the operator would refuse it too: the
  pool that serves a name keeps it, k8s/claims.py), so no pool's routes move to another.
A key hash another entitlement has is refused on the entitlement (k8s/webhook.py), and the
holder keeps it at the operator in any case."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from tokenpools.k8s.claims import served_models
from tokenpools.k8s.schema import LabelSelector

ACKNOWLEDGE = "tokenpools.io/acknowledge-unbinding"  # "<namespace>/<name>,…" or "*"


def selector_of(spec: Mapping[str, Any]) -> LabelSelector | None:
    """A pool spec's namespaceSelector; None (open to no namespace) when absent or malformed."""
    raw = spec.get("namespaceSelector")
    if not isinstance(raw, Mapping):
        return None
    try:
        return LabelSelector.model_validate(raw)
    except ValidationError:
        return None


def unbound_by(
    pool: str,
    spec: Mapping[str, Any],
    entitlements: Iterable[Mapping[str, Any]],
    namespace_labels: Callable[[str], Mapping[str, str]],
) -> list[str]:
    """`<namespace>/<name>` of the entitlements Bound to `pool` whose namespace `spec`'s
    namespaceSelector would no longer match."""
    selector = selector_of(spec)
    out = []
    for ent in entitlements:
        meta, status = ent["metadata"], ent.get("status") or {}
        applied = status.get("appliedSpec") or {}
        if status.get("state") != "Bound" or applied.get("pool") != pool:
            continue
        ns = meta.get("namespace") or ""
        if selector is None or not selector.matches(namespace_labels(ns)):
            out.append(f"{ns}/{meta['name']}")
    return sorted(out)


def acknowledged(annotations: Mapping[str, str] | None, affected: list[str]) -> bool:
    given = {n.strip() for n in (annotations or {}).get(ACKNOWLEDGE, "").split(",")}
    return "*" in given or set(affected) <= given


def unbinding_refusal(affected: list[str]) -> str:
    names = ",".join(affected)
    return (
        f"namespaceSelector: this edit would unbind {len(affected)} Bound entitlements whose "
        f"namespaces it no longer matches: {', '.join(affected)}. To make it anyway, annotate "
        f"the pool {ACKNOWLEDGE}={names} (each keeps its binding for the operator's grace "
        "period, then loses it)"
    )


def model_served_elsewhere(
    pool: str, spec: Mapping[str, Any], pools: Iterable[Mapping[str, Any]]
) -> str | None:
    """Why `spec` may not serve its model names: another pool serves one, in its spec or as
    the operator applied it."""
    mine = set(served_models(spec, pool))
    for other in pools:
        name = other["metadata"]["name"]
        if name == pool or other["metadata"].get("deletionTimestamp"):
            continue
        theirs: set[str] = set()
        for candidate in (other.get("spec"), (other.get("status") or {}).get("appliedSpec")):
            if isinstance(candidate, Mapping):
                theirs.update(m for m in served_models(candidate, name) if isinstance(m, str))
        taken = sorted(mine & theirs)
        if taken:
            return (
                f"servedModels: model {taken[0]!r} is already served by TokenPool {name!r}; a "
                "model name maps to one pool"
            )
    return None
