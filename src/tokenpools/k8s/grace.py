"""How long a Bound entitlement keeps its binding once its pool no longer admits it (pure).

A platform edit can take a tenant's pool away from it: a TokenPool's `namespaceSelector` that
no longer matches the tenant's namespace, or a namespace label removed. The validating webhook
refuses such a pool edit unless the pool acknowledges it (k8s/revocations.py); when it gets
through anyway (no webhook, or a namespace relabelled), the entitlements that were Bound keep
their binding — lease pod, state Bound, the gateway admitting them — for the operator's grace
period (`--binding-grace`, TOKENPOOLS_BINDING_GRACE_S), with the condition `Revoking` saying why
and until when. An edit undone within it changes nothing; past it the entitlement is Invalid
and its lease pod goes. The grace starts when `Revoking` turned True (its lastTransitionTime),
so an operator restart neither restarts nor shortens it, and it lasts whatever the binding's
state meanwhile: a lease pod evicted or preempted during it (Degraded, Pending) does not end it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenpools.k8s.objects import iso, parse_time

REVOKING = "Revoking"  # the condition type
DEFAULT_GRACE_S = 3600.0


@dataclass(frozen=True)
class Grace:
    now: float
    seconds: float = DEFAULT_GRACE_S

    def deadline(self, obj: Mapping[str, Any]) -> float | None:
        """When `obj` loses its binding: counted from when `Revoking` turned True, whatever its
        state since (a lease pod evicted during the grace leaves it Degraded or Pending, not
        revoked), or from now if it is Bound; None when it is neither."""
        status = obj.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") == REVOKING and cond.get("status") == "True":
                since = cond.get("lastTransitionTime")
                return (parse_time(since) if since else self.now) + self.seconds
        if status.get("state") != "Bound":
            return None
        return self.now + self.seconds

    def keeps(self, obj: Mapping[str, Any]) -> float | None:
        """The deadline while the grace lasts; None once it is over (or never began)."""
        deadline = self.deadline(obj)
        return deadline if deadline is not None and self.now < deadline else None


def revoking_message(why: str, deadline: float) -> str:
    return (
        f"{why}; the binding is kept until {iso(deadline)} (the operator's grace period), then "
        "revoked: open the pool to the namespace again, or delete the entitlement"
    )
