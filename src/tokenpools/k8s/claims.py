"""Who holds what among the cluster's objects, and what a spec may not take: a served model
name is its pool's, a key hash its entitlement's, the one whose applied spec has it in force
(k8s/applied.py `held`); a later claimant is refused and falls back to its own applied spec,
never displacing the holder. An entitlement needs its pool, open to its namespace; one that was
Bound keeps its binding for the grace period when only the latter fails (k8s/grace.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tokenpools.k8s.applied import ClusterConfig, Where
from tokenpools.k8s.grace import Grace
from tokenpools.k8s.schema import PoolExtras

CLOSED = "is not open to namespace"


def served_models(spec: Mapping[str, Any], name: str) -> list[Any]:
    return list(spec.get("servedModels") or [name])


def model_taken(
    name: str, served: Mapping[str, str], held_by: Mapping[str, str], got: Any
) -> str | None:
    """A model name is its holder's (the pool whose applied spec serves it, else the first
    this pass): another pool that claims it is refused, never the holder."""
    for model in served_models(got[0], name):
        owner = served.get(model) or held_by.get(model, name)
        if owner != name:
            return (
                f"servedModels: model {model!r} is already served by TokenPool {owner!r}; a "
                "model name maps to one pool, and the pool that serves it keeps it"
            )
    return None


@dataclass(frozen=True)
class Claims:
    """Whose key hashes are whose, as one entitlement (`me`, in namespace `ns`) sees them."""

    me: str
    ns: str
    taken: Mapping[str, str]  # this pass: key → "<namespace>/<name>"
    held_by: Mapping[str, str]  # in force: key → "<namespace>/<name>"

    def conflict(self, keys: Sequence[str]) -> str | None:
        for key in keys:
            owner = self.taken.get(key) or self.held_by.get(key, self.me)
            if owner != self.me:
                # another tenant's entitlement is not named to this one
                who = repr(owner.split("/", 1)[1]) if owner.startswith(f"{self.ns}/") else (
                    "another entitlement")  # fmt: skip
                return (
                    f"apiKeyHashes: {key[:15]}... is already used by {who}; a key maps to one "
                    "entitlement, and the one that holds it keeps it"
                )
        return None


def refused(
    got: Any,
    ns: str,
    pools: Mapping[str, PoolExtras],
    namespaces: Mapping[str, Mapping[str, str]] | None,
    claims: Claims,
    closed_ok: bool = False,
) -> str | None:
    spec = got[0]
    pool = pools.get(spec["pool"])
    if pool is None:
        return f"pool: no valid TokenPool {spec['pool']!r}"
    if namespaces is not None and not closed_ok and not _open(pool, namespaces.get(ns, {})):
        return f"pool: TokenPool {spec['pool']!r} {CLOSED} {ns!r}"
    return claims.conflict(spec["apiKeys"])


def _open(pool: PoolExtras, labels: Mapping[str, str]) -> bool:
    return pool.namespaceSelector is not None and pool.namespaceSelector.matches(labels)


def kept_in_grace(
    obj: Mapping[str, Any],
    where: Where,
    out: ClusterConfig,
    grace: Grace,
    check: Callable[[Mapping[str, Any], Where], Any],
    refuse: Callable[..., str | None],
) -> Any:
    """A Bound entitlement refused only because its pool no longer admits its namespace keeps
    its applied spec, and its binding, until the grace period is over; None otherwise."""
    last = (obj.get("status") or {}).get("appliedSpec")
    deadline = grace.keeps(obj)
    if deadline is None or not isinstance(last, Mapping):
        return None
    try:
        got = check(last, where)
    except ValidationError:
        return None
    why = refuse(got)
    if why is None or CLOSED not in why or refuse(got, closed_ok=True) is not None:
        return None  # in force after all, its pool gone, or a key it does not hold
    out.applied[where] = dict(last)
    out.at_risk[where] = (why, deadline)
    return got
