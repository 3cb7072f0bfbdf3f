"""Which spec of a custom resource is in force: its current one when valid, else the one the
operator last applied (`status.appliedSpec`), so a typo never takes away what was working; and
what the cluster says about each object (`ClusterConfig`). Shared by every kind's assembly
(k8s/custom_resources.py, k8s/budget_objects.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tokenpools.k8s.schema import PoolExtras
from tokenpools.model.config import format_errors

Where = tuple[str, str, str]  # kind, namespace ("" for a pool), name


@dataclass
class ClusterConfig:
    """The config document built from the cluster, and what it says about each object."""

    data: dict[str, Any]
    problems: dict[Where, str] = field(default_factory=dict)  # why a spec is not (fully) used
    applied: dict[Where, dict[str, Any]] = field(default_factory=dict)  # the CR spec in force
    pool_extras: dict[str, PoolExtras] = field(default_factory=dict)
    # Bound entitlements their pool no longer admits, kept for the grace period (k8s/grace.py):
    # why, and when the binding goes
    at_risk: dict[Where, tuple[str, float]] = field(default_factory=dict)

    def in_force(self, where: Where) -> bool:
        return where in self.applied

    def stale(self, where: Where) -> bool:
        """Running on its last applied spec because the current one is refused."""
        return where in self.applied and where in self.problems


def meta_of(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata", {})
    return meta.get("namespace") or "", meta["name"]


def held(
    objects: Sequence[Mapping[str, Any]],
    names: Callable[[Mapping[str, Any], Mapping[str, Any]], Any],
) -> dict[str, str]:
    """Who holds each name (a served model, a key hash) in force: the object whose applied
    spec has it (`names(obj, applied spec)`), the older one first should two have it. A later
    claimant is refused and never displaces it, so an edit elsewhere cannot take it away."""
    out: dict[str, str] = {}
    for obj in sorted(live(objects), key=age):
        last = (obj.get("status") or {}).get("appliedSpec")
        if isinstance(last, Mapping):
            for name in names(obj, last):
                if isinstance(name, str):
                    out.setdefault(name, "/".join(filter(None, meta_of(obj))))
    return out


def age(obj: Mapping[str, Any]) -> tuple[bool, str, str, str]:
    """Who keeps a name or key two objects claim: the one already in force, then the older
    (creationTimestamp has one-second resolution), then by name."""
    meta = obj["metadata"]
    fresh = not (obj.get("status") or {}).get("appliedSpec")
    return (fresh, meta.get("creationTimestamp") or "", meta.get("namespace") or "", meta["name"])


def in_force(
    obj: Mapping[str, Any],
    where: Where,
    check: Any,
    applied_only: bool,
    out: ClusterConfig,
    refuse: Callable[[Any], str | None] | None = None,
) -> tuple[dict[str, Any], Any] | None:
    """(file-schema spec, cluster extras) of the spec in force: the current spec when valid
    and not refused against the others (`refuse`: a name another object holds), else the last
    applied one; None (with the problem recorded) when there is neither."""
    last = (obj.get("status") or {}).get("appliedSpec")
    candidates = [last] if applied_only else [obj.get("spec"), last]
    for i, spec in enumerate(candidates):
        if not isinstance(spec, Mapping):
            continue
        try:
            got = check(spec, where)
        except ValidationError as exc:
            if i == 0:
                out.problems[where] = format_errors(exc)
            continue
        why = None if refuse is None else refuse(got)
        if why is not None:
            out.problems.setdefault(where, why)  # the current spec's problem comes first
            continue
        out.applied[where] = dict(spec)
        return got  # type: ignore[no-any-return]
    if applied_only and where not in out.problems:
        out.problems[where] = "not yet applied by the operator"
    return None


def no_replaced(spec: Mapping[str, Any], replaced: tuple[str, ...], extras: Any) -> None:
    """A field the cluster gives otherwise (the tenant is the namespace, keys are hashes, no
    file paths) is refused, not silently overridden: the extras model forbids it by name."""
    given = {k: spec[k] for k in replaced if k in spec and k not in extras.model_fields}
    if given:
        extras.model_validate(given)


def live(objects: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [o for o in objects if not o["metadata"].get("deletionTimestamp")]
