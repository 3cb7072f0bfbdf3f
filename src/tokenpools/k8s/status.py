"""Status writes that settle: a status is written only when it changed, and a condition keeps
its `lastTransitionTime` until its status flips (the API conventions), so an idle
reconciliation writes nothing — and a write is a watch event that would wake another one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from tokenpools.k8s.api import Kind, Kube
from tokenpools.k8s.applied import ClusterConfig, Where
from tokenpools.k8s.objects import condition

SPEC_ACCEPTED = "SpecAccepted"


class Condition(NamedTuple):
    """A condition as a controller decides it; `conditions` adds its times."""

    type: str
    ok: bool
    reason: str
    message: str


def spec_accepted(
    cluster: ClusterConfig | None, where: Where, refused: str | None = None
) -> Condition:
    """Whether the object's spec is the one in force: `refused` (why) when it is refused with
    nothing in force, stale when the object runs its last applied spec because the current one
    is refused, else accepted."""
    if refused is not None:
        return Condition(SPEC_ACCEPTED, False, "Invalid", refused)
    if cluster is not None and cluster.stale(where):
        return Condition(SPEC_ACCEPTED, False, "Invalid", cluster.problems[where])
    return Condition(SPEC_ACCEPTED, True, "Accepted", "spec applied")


def conditions(
    old: Sequence[Mapping[str, Any]] | None,
    new: Sequence[Condition],
    now: float,
    gen: int,
) -> list[dict[str, Any]]:
    """(type, ok, reason, message) → conditions, each transition time carried over when its
    status did not change; conditions of other types (another writer's) are kept."""
    before = {c.get("type"): c for c in old or []}
    mine = {kind for kind, *_ in new}
    out = [dict(c) for c in old or [] if c.get("type") not in mine]
    for kind, ok, reason, message in new:
        cond = condition(kind, ok, reason, message, now, gen)
        prev = before.get(kind)
        if prev is not None and prev.get("status") == cond["status"]:
            cond["lastTransitionTime"] = prev.get("lastTransitionTime", cond["lastTransitionTime"])
        out.append(cond)
    return out


def write_status(kube: Kube, kind: Kind, obj: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Merge `status` into the object's status unless it is there already; True if written."""
    old = obj.get("status") or {}
    if all(old.get(k) == v for k, v in status.items()):
        return False
    meta = obj["metadata"]
    patch = {"status": {k: diff(old.get(k), v) for k, v in status.items()}}
    kube.patch(kind, meta.get("namespace"), meta["name"], patch, sub="status")
    return True


def diff(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: a key `new` lacks is
    removed, not kept (a spec recorded in status must not keep a field that was dropped)."""
    if not isinstance(new, Mapping) or not isinstance(old, Mapping):
        return new
    out: dict[str, Any] = {k: None for k in old if k not in new}
    out.update({k: diff(old.get(k), v) for k, v in new.items()})
    return out
