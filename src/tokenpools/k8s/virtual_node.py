"""Acting as each pool's virtual node and its kubelet: the Node object and its Lease, the
heartbeat, and the kubelet's duties towards the pods bound to it.

The heartbeat is separate from reconciliation and renews each node on its own: a failing
write for one pool, or a reconciliation that keeps failing, never lets another node's
heartbeat lapse (the node lifecycle controller would mark it Unknown and, after its
toleration, evict every pod on it).

Only its own nodes: a Node is this installation's when it carries `tokenpools.io/installation`
with this installation's id. A Node of the same name without it (someone's real node, or
another installation's virtual node) is never adopted: not patched, no heartbeat, its pods
neither failed nor finalized, and not deleted with the pool (`NodeConflict`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from tokenpools.control.placement import RESOURCE_PREFIX, Placed, survivors
from tokenpools.k8s import objects as o
from tokenpools.k8s import quantity
from tokenpools.k8s.api import LEASES, NODES, PODS, Kube
from tokenpools.k8s.errors import describe
from tokenpools.k8s.lease_proof import Lease, proof
from tokenpools.k8s.names import node_name
from tokenpools.k8s.operator_metrics import OperatorMetrics

log = logging.getLogger("tokenpools.operator")
VIRTUAL = {"type": "virtual-kubelet"}
NOT_OURS = "only the lease pods the tokenpools operator creates run on a tokenpools virtual node"


class NodeConflict(Exception):
    """The pool's node name is taken by a Node that is not this installation's."""

    def __init__(self, node: str, installation: str) -> None:
        super().__init__(
            f"node {node} exists and is not this installation's (no label "
            f"{o.INSTALLATION_LABEL}={installation}): it is left alone and nothing is bound to "
            "it; delete it, or label it so to hand it over"
        )
        self.node = node


class VirtualNodes:
    def __init__(
        self,
        kube: Kube,
        clock: Callable[[], float],
        metrics: OperatorMetrics,
        installation: str = o.DEFAULT_INSTALLATION,
    ) -> None:
        self.kube, self.clock, self.metrics = kube, clock, metrics
        self.installation = installation

    def ours(self, node: Mapping[str, Any]) -> bool:
        labels = node["metadata"].get("labels") or {}
        return labels.get(o.INSTALLATION_LABEL) == self.installation

    def ensure(self, pool: str, alloc: Mapping[str, int], message: str) -> str:
        """The pool's node exists and advertises `alloc`; written only when that changed.
        Raises NodeConflict, writing nothing, when a Node not ours has its name."""
        name = node_name(pool)
        node = self.kube.find(NODES, None, name)
        if node is None:
            node = self.kube.create(NODES, None, o.node(pool, self.installation))
            log.info("node %s created", name)
        if not self.ours(node):
            raise NodeConflict(name, self.installation)
        status = node.get("status") or {}
        want = o.node_status(alloc, self.clock(), message)["status"]
        ready = {c.get("type"): c for c in status.get("conditions") or []}.get("Ready") or {}
        if status.get("allocatable") != want["allocatable"] or ready.get("message") != message:
            self.kube.patch(NODES, None, name, {"status": want}, sub="status")
            self._renew_lease(name)
            self.metrics.beat(name)
        return name

    def remove(self, pool: str) -> None:
        """The pool's node and its Lease, if the node is ours (or gone)."""
        name = node_name(pool)
        node = self.kube.find(NODES, None, name)
        if node is not None and not self.ours(node):
            log.warning("pool %s deleted: node %s is not ours, left alone", pool, name)
            return
        self.kube.delete(NODES, None, name)
        self.kube.delete(LEASES, o.NODE_LEASE_NAMESPACE, name)
        self.metrics.forget(name)

    def nodes(self) -> list[Any]:
        """This installation's virtual nodes."""
        mine = {**VIRTUAL, o.INSTALLATION_LABEL: self.installation}
        return [
            n
            for n in self.kube.list(NODES, labels=mine)
            if o.POOL_LABEL in (n["metadata"].get("labels") or {})
        ]

    def heartbeat(self) -> int:
        """Renew every virtual node's Ready condition and Lease; the number of nodes whose
        heartbeat failed. Each write is retried on its own, as the kubelet keeps the two apart:
        either keeps the node alive for the node lifecycle controller, so one that keeps
        failing must not leave the other stale. The condition goes first: a node deleted since
        it was listed (its pool removed meanwhile) is then seen gone, and gets no new Lease."""
        failed = 0
        for node in self.nodes():
            name = node["metadata"]["name"]
            try:
                retried(functools.partial(self._ready, node))
                ready = True
            except Exception as exc:
                if describe(exc)[0] == "NotFound":
                    continue  # deleted since it was listed: nothing to renew
                self._failed(name, exc)
                ready = False
            try:
                retried(functools.partial(self._renew_lease, name))
                leased = True
            except Exception as exc:
                self._failed(name, exc)
                leased = False
            failed += not (ready and leased)
            if ready or leased:
                self.metrics.beat(name)
        return failed

    def _failed(self, node: str, exc: Exception) -> None:
        """One heartbeat write failed (retried already): counted and said."""
        reason, message = describe(exc)
        self.metrics.errors.labels("Node", reason).inc()
        log.warning("node %s: heartbeat failed: %s", node, message)

    def _ready(self, node: Any) -> None:
        now = o.iso(self.clock())
        conditions = (node.get("status") or {}).get("conditions") or []
        for cond in conditions:
            cond["lastHeartbeatTime"] = now
        self.kube.patch(
            NODES,
            None,
            node["metadata"]["name"],
            {"status": {"conditions": conditions}},
            sub="status",
        )

    def _renew_lease(self, node: str) -> None:
        lease = o.node_lease(node, self.clock())
        try:
            self.kube.patch(LEASES, o.NODE_LEASE_NAMESPACE, node, {"spec": lease["spec"]})
        except Exception as exc:
            if describe(exc)[0] != "NotFound":
                raise
            self.kube.create(LEASES, o.NODE_LEASE_NAMESPACE, lease)

    def kubelet(self, node: str, alloc: Mapping[str, int], ours: Mapping[str, str]) -> None:
        """As the node's kubelet: finalize terminating pods at once (so preemption frees their
        resources), fail pods that are not lease pods the operator made for a live entitlement
        (`ours`: uid → name), run the others, and evict what no longer fits a shrunk node."""
        now = self.clock()
        live = []
        for pod in self.kube.list(PODS, fields={"spec.nodeName": node}):
            ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
            phase = (pod.get("status") or {}).get("phase")
            if pod["metadata"].get("deletionTimestamp"):
                self.kube.delete(PODS, ns, name, grace_s=0)
            elif not self._is_lease(pod, ours):
                if phase != "Failed":
                    log.warning("node %s: pod %s/%s is not a lease pod: Failed", node, ns, name)
                    patch = o.failed_status("NotALeasePod", NOT_OURS)
                    self.kube.patch(PODS, ns, name, patch, sub="status")
            else:
                live.append(pod)
        placed = [
            Placed(_key(p), int(p["spec"].get("priority") or 0), requests(p), _started(p))
            for p in live
        ]
        kept = survivors(placed, alloc)
        for pod in live:
            ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
            if _key(pod) not in kept:
                log.info("node %s: evicting %s/%s, it no longer fits", node, ns, name)
                self.kube.delete(PODS, ns, name, grace_s=0)
            elif (pod.get("status") or {}).get("phase") != "Running":
                self.kube.patch(PODS, ns, name, o.running_status(now), sub="status")

    def _is_lease(self, pod: Mapping[str, Any], ours: Mapping[str, str]) -> bool:
        uid = o.owner_uid(pod)
        if uid is None or uid not in ours:
            return False
        return isinstance(proof(pod, uid, ours[uid], self.installation), Lease)


def retried(step: Callable[[], Any], tries: int = 3) -> Any:
    """A heartbeat write retried at once, as the kubelet retries its node status: one lost
    write must not cost a whole heartbeat period."""
    for attempt in range(tries):
        try:
            return step()
        except Exception:
            if attempt == tries - 1:
                raise
    return None


def requests(pod: Mapping[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in pod["spec"].get("containers", []):
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            if k.startswith(RESOURCE_PREFIX):  # canonical form on the server: "40k"
                out[k] = out.get(k, 0) + (quantity.whole(v) or 0)
    return out


def _key(pod: Mapping[str, Any]) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def _started(pod: Mapping[str, Any]) -> int:
    start = (pod.get("status") or {}).get("startTime")
    return int(o.parse_time(start)) if start else 0
