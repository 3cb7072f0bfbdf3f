"""One entitlement's lease pods and the state they give it.

The spec in force is the current one when valid, else the last applied (`ClusterConfig`): an
invalid edit changes nothing but a condition. A valid edit that changes what the lease pod
requests (or its priority) is a new pod, made beside the old one; the entitlement stays Bound
under its applied spec until the new pod binds, then the old pod goes — a resize never leaves
a tenant without its binding while it waits for room.

Bound means a pod the operator made, exactly as it makes them (k8s/lease_proof.py), bound to
its pool's node: a pod that only looks like a lease pod (a tenant's, with the label, the owner
and the name but not the requests, or with other containers) never counts, and is deleted."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from tokenpools.control.placement import lease_requests
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, EVENTS, PODS, Conflict, Kube
from tokenpools.k8s.applied import ClusterConfig
from tokenpools.k8s.grace import REVOKING, revoking_message
from tokenpools.k8s.lease_proof import Lease, other_installation, proof
from tokenpools.k8s.names import entitlement_key, node_name
from tokenpools.k8s.status import SPEC_ACCEPTED, Condition, conditions, spec_accepted, write_status
from tokenpools.model.config import Config
from tokenpools.model.entitlement import BindingState

log = logging.getLogger("tokenpools.operator")
BOUND, DEGRADED, PENDING = (s.value for s in (BindingState.BOUND, BindingState.DEGRADED,
                                               BindingState.PENDING))  # fmt: skip
EXPIRED, INVALID = BindingState.EXPIRED.value, "Invalid"


class LeasePods:
    def __init__(
        self, kube: Kube, clock: Callable[[], float], installation: str = o.DEFAULT_INSTALLATION
    ) -> None:
        self.kube, self.clock, self.installation = kube, clock, installation

    def reconcile(self, obj: Any, cluster: ClusterConfig, config: Config, pods: list[Any]) -> str:
        """Make the entitlement's lease pods match its spec in force; its state."""
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        where = ("TokenEntitlement", ns, name)
        if not cluster.in_force(where):  # never valid, or refused as a whole (pool, key)
            self._delete(pods)
            return self._status(obj, INVALID, cluster.problems.get(where, "invalid"), None, {})
        applied = cluster.applied[where]
        ent = config.entitlements[entitlement_key(ns, name)]
        pods = self._genuine(obj, pods)
        node = node_name(ent.pool)

        def bound(pod: Any) -> bool:  # by the scheduler (the operator never sets nodeName)
            return bool(
                pod
                and pod["spec"].get("nodeName") == node
                and not pod["metadata"].get("deletionTimestamp")
            )

        if ent.expires_at is not None and self.clock() >= ent.expires_at:
            self._delete(pods)
            return self._status(obj, EXPIRED, "past expiresAt", applied, {}, cluster)
        want = lease_requests(ent)
        pod_name = o.lease_pod_name(name, ent.service_class, want)
        target = next((p for p in pods if p["metadata"]["name"] == pod_name), None)
        if target is None:
            target, why = self._create(obj, ent.service_class, want, pod_name)
        else:
            why = None
        others = [p for p in pods if p is not target]
        if bound(target):
            self._delete(others)
            return self._status(
                obj, BOUND, f"lease pod bound to {node}", applied, want, cluster, target
            )
        waiting = why or _unschedulable(target) or "lease pod waiting for the scheduler"
        old = obj.get("status") or {}
        still = [p for p in others if bound(p)]
        if still and old.get("state") == BOUND and old.get("appliedSpec"):
            message = f"resize waiting, the current lease stays: {waiting}"
            return self._status(
                obj, BOUND, message, old["appliedSpec"], old.get("requests") or {}, cluster,
                still[0],
            )  # fmt: skip
        self._delete(others)
        state = DEGRADED if old.get("state") in (BOUND, DEGRADED) else PENDING
        return self._status(obj, state, waiting, applied, want, cluster, target)

    def finalize(self, pods: list[Any]) -> None:
        self._delete([p for p in pods if not other_installation(p, self.installation)])

    def _genuine(self, obj: Any, pods: list[Any]) -> list[Any]:
        """The entitlement's pods the operator made; a pod that only looks like one is
        deleted (with a Warning Event), and one of another installation is left alone."""
        meta, out = obj["metadata"], []
        for pod in pods:
            held = proof(pod, meta["uid"], meta["name"], self.installation)
            if isinstance(held, Lease):
                out.append(pod)
            elif not other_installation(pod, self.installation):
                why = f"pod {pod['metadata']['name']} is not a lease pod the operator made ({held})"
                log.warning("%s/%s: %s: deleted", meta["namespace"], meta["name"], why)
                self._delete([pod])
                event = o.event(obj, "NotALeasePod", f"{why}: deleted", self.clock(), "Warning")
                self.kube.create(EVENTS, meta["namespace"], event)
        return out

    def _create(
        self, obj: Any, service_class: Any, want: Mapping[str, int], pod_name: str
    ) -> tuple[Any, str | None]:
        ns = obj["metadata"]["namespace"]
        try:
            return self.kube.create(
                PODS, ns, o.lease_pod(obj, service_class, want, self.installation)
            ), None
        except Conflict:  # a pod of that name: a terminating one of ours, or someone else's
            pod = self.kube.find(PODS, ns, pod_name)
            meta = obj["metadata"]
            if pod is not None and not isinstance(
                proof(pod, meta["uid"], meta["name"], self.installation), Lease
            ):
                return None, f"pod {pod_name!r}, not made by the operator, is in the way"
            return pod, None

    def _delete(self, pods: list[Any]) -> None:
        for pod in pods:
            meta = pod["metadata"]
            self.kube.delete(PODS, meta["namespace"], meta["name"], grace_s=0)

    def _status(
        self,
        obj: Any,
        state: str,
        why: str,
        applied: Mapping[str, Any] | None,
        requests: Mapping[str, int],
        cluster: ClusterConfig | None = None,
        pod: Any = None,
    ) -> str:
        meta, old = obj["metadata"], obj.get("status") or {}
        gen, now = meta.get("generation", 1), self.clock()
        where = ("TokenEntitlement", meta["namespace"], meta["name"])
        conds = [Condition(k, state == k, state, why) for k in (BOUND, DEGRADED, PENDING, EXPIRED)]
        stale = cluster is not None and cluster.stale(where)
        spec = spec_accepted(cluster, where, why if state == INVALID else None)
        conds.append(spec)
        risk = None if cluster is None else cluster.at_risk.get(where)
        if risk is not None:
            revoking = revoking_message(*risk)
            conds.append(Condition(REVOKING, True, "PoolClosed", revoking))
        else:
            conds.append(Condition(REVOKING, False, "InForce", "nothing takes the binding away"))
        status = {
            "state": state,
            "message": why,
            "observedGeneration": gen,
            "appliedSpec": None if applied is None else dict(applied),
            "conditions": conditions(old.get("conditions"), conds, now, gen),
            "requests": dict(requests),
            "podName": (pod or {}).get("metadata", {}).get("name"),
            "nodeName": (pod or {}).get("spec", {}).get("nodeName") if state == BOUND else None,
        }
        write_status(self.kube, ENTITLEMENTS, obj, status)
        was = [
            c.get("status") for c in old.get("conditions") or [] if c.get("type") == SPEC_ACCEPTED
        ]
        before = {c.get("type"): c.get("status") for c in old.get("conditions") or []}
        if risk is not None and before.get(REVOKING) != "True":
            event = o.event(obj, REVOKING, revoking, now, "Warning")
            self.kube.create(EVENTS, meta["namespace"], event)
        if old.get("state") != state or (stale and was != ["False"]):
            kind = "Warning" if state in (DEGRADED, INVALID) or stale else "Normal"
            reason = "InvalidSpec" if stale and old.get("state") == state else state
            text = f"{why}; {spec.message}" if stale else why
            self.kube.create(EVENTS, meta["namespace"], o.event(obj, reason, text, now, kind))
        return state


def _unschedulable(pod: Any) -> str | None:
    for cond in ((pod or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message") or cond.get("reason"))
    return None
