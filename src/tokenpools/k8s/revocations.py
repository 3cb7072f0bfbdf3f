"""What a TokenPool edit would take from tenants, for the validating webhook (pure).

A platform edit must never revoke a tenant silently. Of the edits that could:
- a `namespaceSelector` that no longer matches the namespace of an entitlement that is Bound to
  the pool: refused, naming every such entitlement, unless the same request acknowledges
  exactly those (adds or changes the annotation below, or sets it to `*`: an acknowledgement
  left on the pool by an earlier edit approves nothing later); acknowledged or not, the
  operator still keeps each binding for its grace period (k8s/grace.py), so an edit that got
  through (no webhook) can be undone;
- a served model name another pool serves: refused (the operator would refuse it too: the
  pool that serves a name keeps it, k8s/claims.py), so no pool's routes move to another.
An update is judged by what it changes (the request's oldObject against its object): only the
entitlements the old selector admitted and the new one does not are named, and only model
names the edit adds are checked, so an edit that leaves both alone (an annotation, a finalizer,
replicas) is never refused for the cluster's state.
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
    old_spec: Mapping[str, Any] | None = None,
) -> list[str]:
    """`<namespace>/<name>` of the entitlements Bound to `pool` whose namespace `spec`'s
    namespaceSelector would no longer match; on an update (`old_spec`), only those the old
    namespaceSelector matched, and none when the edit leaves the namespaceSelector as it was."""
    if old_spec is not None and old_spec.get("namespaceSelector") == spec.get("namespaceSelector"):
        return []
    selector = selector_of(spec)
    before = selector_of(old_spec) if old_spec is not None else None
    out = []
    for ent in entitlements:
        meta, status = ent["metadata"], ent.get("status") or {}
        applied = status.get("appliedSpec") or {}
        if status.get("state") != "Bound" or applied.get("pool") != pool:
            continue
        ns = meta.get("namespace") or ""
        labels = namespace_labels(ns)
        if old_spec is not None and (before is None or not before.matches(labels)):
            continue  # not this edit's doing
        if selector is None or not selector.matches(labels):
            out.append(f"{ns}/{meta['name']}")
    return sorted(out)


def acknowledged(
    annotations: Mapping[str, str] | None,
    affected: list[str],
    old_annotations: Mapping[str, str] | None = None,
) -> bool:
    """Whether the request acknowledges unbinding `affected`: the annotation names them all (or
    is `*`), and this request added or changed it (on an update, `old_annotations` are the
    pool's before it), so an acknowledgement left from an earlier edit approves nothing."""
    value = (annotations or {}).get(ACKNOWLEDGE)
    if value is None or value == (old_annotations or {}).get(ACKNOWLEDGE):
        return False
    given = {n.strip() for n in value.split(",")}
    return "*" in given or set(affected) <= given


def unbinding_refusal(affected: list[str]) -> str:
    names = ",".join(affected)
    return (
        f"namespaceSelector: this edit would unbind {len(affected)} Bound entitlements whose "
        f"namespaces it no longer matches: {', '.join(affected)}. To make it anyway, annotate "
        f"the pool {ACKNOWLEDGE}={names} in this same edit (each keeps its binding for the "
        "operator's grace period, then loses it)"
    )


def model_served_elsewhere(
    pool: str,
    spec: Mapping[str, Any],
    pools: Iterable[Mapping[str, Any]],
    old_spec: Mapping[str, Any] | None = None,
) -> str | None:
    """Why `spec` may not serve its model names: another pool serves one, in its spec or as
    the operator applied it. On an update (`old_spec`), only the names the edit adds."""
    mine = set(served_models(spec, pool))
    if old_spec is not None:
        mine -= set(served_models(old_spec, pool))
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
