"""Each object reconciled on its own: a step that fails is recorded (metrics, a log line, a
`Reconciled=False` condition and an Event naming the API error) and tried again after its
own backoff, 1 s doubling to 5 min; the next success clears it and says so."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tokenpools.backoff import Backoff
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import BUDGETS, ENTITLEMENTS, EVENTS, POOLS, Kube
from tokenpools.k8s.errors import describe
from tokenpools.k8s.operator_metrics import OperatorMetrics
from tokenpools.k8s.status import Condition, conditions, write_status

log = logging.getLogger("tokenpools.operator")
BACKOFF_S, BACKOFF_MAX_S = 1.0, 300.0


def _backoff() -> Backoff:
    """Without jitter: one operator replica acts at a time, so nothing comes back in a herd."""
    return Backoff(BACKOFF_S, BACKOFF_MAX_S, jitter=lambda: 0.0)


class Retries:
    def __init__(
        self, kube: Kube, clock: Callable[[], float], metrics: OperatorMetrics, namespace: str
    ) -> None:
        self.kube, self.clock, self.metrics = kube, clock, metrics
        self.namespace = namespace  # where an Event about a cluster-scoped object goes
        # per failing object (kind, namespace, name): its backoff and when it is tried again
        self._due: dict[tuple[str, str, str], tuple[Backoff, float]] = {}

    def run(self, kind: str, obj: Any, step: Callable[[], Any]) -> Any:
        """`step()`'s result, or None when it failed (recorded) or waits out its backoff."""
        meta = obj["metadata"]
        key = (kind, meta.get("namespace") or "", meta["name"])
        backoff, not_before = self._due.get(key) or (_backoff(), 0.0)
        if self.clock() < not_before:
            return None
        try:
            result = step()
        except Exception as exc:
            reason, message = describe(exc)
            delay = backoff.next()
            self._due[key] = (backoff, self.clock() + delay)
            self.metrics.reconciles.labels(kind, "error").inc()
            self.metrics.errors.labels(kind, reason).inc()
            log.warning("%s %s: %s (again in %.0f s)", kind, "/".join(key[1:]), message, delay)
            self._report(kind, obj, reason, message)
            return None
        self._due.pop(key, None)
        self.metrics.reconciles.labels(kind, "ok").inc()
        if backoff.failures:
            self._report(kind, obj, None, "reconciled")
        return result

    def _report(self, kind: str, obj: Any, reason: str | None, message: str) -> None:
        """The Reconciled condition and, on a failure, an Event; itself best-effort."""
        which = {"TokenPool": POOLS, "TokenBudget": BUDGETS}.get(kind, ENTITLEMENTS)
        cond = Condition("Reconciled", reason is None, reason or "Reconciled", message)
        try:
            if reason is None:  # the step just wrote this object's status: start from that
                meta = obj["metadata"]
                obj = self.kube.get(which, meta.get("namespace"), meta["name"])
            gen = obj["metadata"].get("generation", 1)
            old = (obj.get("status") or {}).get("conditions") or []
            merged = conditions(old, [cond], self.clock(), gen)
            write_status(self.kube, which, obj, {"conditions": merged})
            if reason is not None:
                ns = obj["metadata"].get("namespace") or self.namespace
                event = o.event(obj, "ReconcileError", message, self.clock(), "Warning")
                self.kube.create(EVENTS, ns, event)
        except Exception:
            log.debug("could not report on %s", obj["metadata"]["name"], exc_info=True)
