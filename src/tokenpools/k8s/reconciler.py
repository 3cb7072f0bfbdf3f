"""The operator's level-triggered reconciliation: read every TokenPool, TokenEntitlement and
lease pod, then make the cluster match — virtual nodes, their kubelet duties, lease pods,
statuses and the scale of each pool's workload. Idempotent: running it twice, or after a
restart, changes nothing more. The clock is injected; all I/O goes through `Kube`."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from tokenpools.control.autoscale import baseline_need, desired_replicas
from tokenpools.control.placement import Placed, lease_requests, pool_allocatable, survivors
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import (
    ENTITLEMENTS,
    EVENTS,
    LEASES,
    NODES,
    PODS,
    POOLS,
    Conflict,
    Kube,
    workload_kind,
)
from tokenpools.k8s.resources import config_data
from tokenpools.model.config import Config, ConfigError, parse_config
from tokenpools.model.entitlement import BindingState
from tokenpools.model.pool import Pool

log = logging.getLogger("tokenpools.operator")


class Reconciler:
    def __init__(self, kube: Kube, clock: Callable[[], float]) -> None:
        self.kube = kube
        self.clock = clock

    # -- the whole cluster -------------------------------------------------------------

    def reconcile(self) -> None:
        now = self.clock()
        pools: dict[str, list[Any]] = defaultdict(list)
        ents: dict[str, list[Any]] = defaultdict(list)
        for obj in self.kube.list(POOLS):
            pools[obj["metadata"]["namespace"]].append(obj)
        for obj in self.kube.list(ENTITLEMENTS):
            ents[obj["metadata"]["namespace"]].append(obj)
        pods = self.kube.list(PODS)
        on_node: dict[str, list[Any]] = defaultdict(list)
        for pod in pods:
            on_node[pod["spec"].get("nodeName") or ""].append(pod)
        leases = {
            (p["metadata"]["namespace"], p["metadata"]["name"]): p
            for p in pods
            if o.ENTITLEMENT_LABEL in (p["metadata"].get("labels") or {})
        }
        for ns in sorted(set(pools) | set(ents)):
            self._namespace(ns, pools[ns], ents[ns], leases, on_node, now)
        self._forget_orphan_nodes({(ns, p["metadata"]["name"]) for ns in pools for p in pools[ns]})

    def _namespace(
        self,
        ns: str,
        pools: list[Any],
        ents: list[Any],
        leases: Mapping[tuple[str, str], Any],
        on_node: Mapping[str, list[Any]],
        now: float,
    ) -> None:
        cluster = config_data(pools, ents, None)
        try:
            config = parse_config(cluster.data)
        except ConfigError as exc:  # a cross-object problem; each object is valid alone
            log.error("namespace %s: %s", ns, exc)
            return
        for obj in pools:
            name = obj["metadata"]["name"]
            if obj["metadata"].get("deletionTimestamp"):
                self._delete_pool(obj)
            elif ("TokenPool", ns, name) in cluster.invalid:
                why = cluster.invalid[("TokenPool", ns, name)]
                gen = obj["metadata"].get("generation", 1)
                ready = o.condition("Ready", False, "Invalid", why, now, gen)
                self._status(POOLS, obj, {"conditions": [ready]})
            else:
                node = o.node_name(ns, name)
                self._pool(obj, config, cluster.pool_extras[name], on_node.get(node, []), now)
        for obj in ents:
            key = (ns, o.pod_name(obj["metadata"]["name"]))
            self._entitlement(obj, config, cluster.invalid, leases.get(key), now)

    # -- pools: the virtual node, its kubelet duties, autoscaling ---------------------

    def _pool(self, obj: Any, config: Config, extras: Any, bound: list[Any], now: float) -> None:
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        self._finalizer(POOLS, obj)
        pool = config.pools[name]
        ready, current = self._replicas(ns, pool, extras)
        live = pool.with_replicas(ready)
        alloc = pool_allocatable(live, config.policy.elastic_oversubscription)
        node = o.node_name(ns, name)
        if self.kube.find(NODES, None, node) is None:
            self.kube.create(NODES, None, o.node(ns, name))
            log.info("node %s created", node)
        message = f"{ready} ready replicas of {pool.per_replica}"
        self.kube.patch(NODES, None, node, o.node_status(alloc, now, message), sub="status")
        self._renew_node_lease(node, now)
        self._kubelet(node, bound, alloc, now)
        members = [e for e in config.entitlements.values() if e.pool == name]
        desired = desired_replicas(pool, baseline_need(members))
        status: dict[str, Any] = {
            "nodeName": node,
            "replicas": ready,
            "desiredReplicas": desired,
            "capacity": alloc,
        }
        if extras.scaleTargetRef is not None and desired != current:
            status |= self._scale(obj, extras, current, desired, now)
        gen = obj["metadata"].get("generation", 1)
        status["observedGeneration"] = gen
        status["conditions"] = [o.condition("Ready", True, "NodeReady", message, now, gen)]
        self._status(POOLS, obj, status)

    def _replicas(self, ns: str, pool: Pool, extras: Any) -> tuple[int, int]:
        """(ready replicas, replicas asked for): the workload's, else the spec's."""
        ref = extras.scaleTargetRef
        if ref is None:
            return pool.replicas, pool.replicas
        workload = self.kube.find(workload_kind(ref.apiVersion, ref.kind), ns, ref.name)
        if workload is None:
            return 0, 0
        asked = int(workload.get("spec", {}).get("replicas", 0))
        status = workload.get("status") or {}
        ready = status.get("readyReplicas", status.get("replicas", 0))
        return int(ready or 0), asked

    def _scale(
        self, obj: Any, extras: Any, current: int, desired: int, now: float
    ) -> dict[str, Any]:
        last = (obj.get("status") or {}).get("lastScaleTime")
        if last is not None and now - o.parse_time(last) < extras.autoscaling.cooldownS:
            return {"lastScaleTime": last}
        ref, ns = extras.scaleTargetRef, obj["metadata"]["namespace"]
        kind = workload_kind(ref.apiVersion, ref.kind)
        self.kube.patch(kind, ns, ref.name, {"spec": {"replicas": desired}}, sub="scale")
        why = (
            f"scaled {ref.kind}/{ref.name} from {current} to {desired} replicas: the reserved "
            f"and elastic baselines of the pool's entitlements need {desired}"
        )
        self.kube.create(EVENTS, ns, o.event(obj, "Scaled", why, now))
        log.info("pool %s/%s: %s", ns, obj["metadata"]["name"], why)
        return {"lastScaleTime": o.iso(now)}

    def _renew_node_lease(self, node: str, now: float) -> None:
        lease = o.node_lease(node, now)
        if self.kube.find(LEASES, o.NODE_LEASE_NAMESPACE, node) is None:
            self.kube.create(LEASES, o.NODE_LEASE_NAMESPACE, lease)
        else:
            self.kube.patch(LEASES, o.NODE_LEASE_NAMESPACE, node, {"spec": lease["spec"]})

    def heartbeat(self) -> None:
        """Between reconciliations: keep every virtual node Ready and its Lease fresh."""
        now = self.clock()
        for node in self.kube.list(NODES, labels={"type": "virtual-kubelet"}):
            name = node["metadata"]["name"]
            if o.POOL_LABEL not in (node["metadata"].get("labels") or {}):
                continue
            conditions = (node.get("status") or {}).get("conditions") or []
            for cond in conditions:
                cond["lastHeartbeatTime"] = o.iso(now)
            self.kube.patch(NODES, None, name, {"status": {"conditions": conditions}}, sub="status")
            self._renew_node_lease(name, now)

    def _kubelet(self, node: str, bound: list[Any], alloc: Mapping[str, int], now: float) -> None:
        """As the node's kubelet: finalize terminating pods at once (so preemption frees
        their resources), run bound ones, and evict what no longer fits a shrunk node."""
        live = []
        for pod in bound:
            if pod["metadata"].get("deletionTimestamp"):
                self.kube.delete(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], 0)
            else:
                live.append(pod)
        placed = [
            Placed(_key(p), int(p["spec"].get("priority") or 0), _requests(p), _started(p))
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

    def _delete_pool(self, obj: Any) -> None:
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        node = o.node_name(ns, name)
        self.kube.delete(NODES, None, node)
        self.kube.delete(LEASES, o.NODE_LEASE_NAMESPACE, node)
        self._drop_finalizer(POOLS, obj)
        log.info("pool %s/%s deleted: node %s removed", ns, name, node)

    def _forget_orphan_nodes(self, pools: set[tuple[str, str]]) -> None:
        for node in self.kube.list(NODES, labels={"type": "virtual-kubelet"}):
            labels = node["metadata"].get("labels") or {}
            key = (labels.get(o.NAMESPACE_LABEL), labels.get(o.POOL_LABEL))
            if o.POOL_LABEL in labels and key not in pools:
                self.kube.delete(NODES, None, node["metadata"]["name"])

    # -- entitlements: lease pods and their state ---------------------------------------

    def _entitlement(
        self, obj: Any, config: Config, invalid: Mapping[Any, str], pod: Any, now: float
    ) -> None:
        meta = obj["metadata"]
        ns, name, gen = meta["namespace"], meta["name"], meta.get("generation", 1)
        if meta.get("deletionTimestamp"):
            self.kube.delete(PODS, ns, o.pod_name(name), grace_s=0)
            self._drop_finalizer(ENTITLEMENTS, obj)
            return
        self._finalizer(ENTITLEMENTS, obj)
        previous = (obj.get("status") or {}).get("state")
        if ("TokenEntitlement", ns, name) in invalid:
            self.kube.delete(PODS, ns, o.pod_name(name), grace_s=0)
            why = invalid[("TokenEntitlement", ns, name)]
            self._set_state(obj, "Invalid", why, gen, now, {})
            return
        ent = config.entitlements[name]
        if ent.expires_at is not None and now >= ent.expires_at:
            self.kube.delete(PODS, ns, o.pod_name(name), grace_s=0)
            self._set_state(obj, BindingState.EXPIRED.value, "past expiresAt", gen, now, {})
            return
        requests = lease_requests(ent)
        if pod is not None and _requests(pod) != requests:  # resources of a pod are immutable
            self.kube.delete(PODS, ns, pod["metadata"]["name"], grace_s=0)
            pod = None
        if pod is None:
            try:
                pod = self.kube.create(PODS, ns, o.lease_pod(obj, ent.service_class, requests))
            except Conflict:  # a terminating pod of the same name: next round
                pod = self.kube.find(PODS, ns, o.pod_name(name))
        node = (pod or {}).get("spec", {}).get("nodeName")
        terminating = bool((pod or {}).get("metadata", {}).get("deletionTimestamp"))
        if node and not terminating:
            state, why = BindingState.BOUND.value, f"lease pod bound to {node}"
        else:
            waiting = previous in (BindingState.BOUND.value, BindingState.DEGRADED.value)
            state = BindingState.DEGRADED.value if waiting else BindingState.PENDING.value
            why = _unschedulable(pod) or "lease pod waiting for the scheduler"
        self._set_state(
            obj, state, why, gen, now, requests, pod, node if state == "Bound" else None
        )

    def _set_state(
        self,
        obj: Any,
        state: str,
        why: str,
        gen: int,
        now: float,
        requests: Mapping[str, int],
        pod: Any = None,
        node: str | None = None,
    ) -> None:
        old = obj.get("status") or {}
        if (old.get("state"), old.get("message"), old.get("observedGeneration")) == (
            state,
            why,
            gen,
        ):
            return  # unchanged: no write, so an idle reconciliation is free
        conds = [
            o.condition(kind, state == kind, state, why, now, gen)
            for kind in ("Bound", "Degraded", "Pending", "Expired")
        ]
        status = {
            "state": state,
            "message": why,
            "observedGeneration": gen,
            "conditions": conds,
            "requests": dict(requests),
            "podName": (pod or {}).get("metadata", {}).get("name"),
            "nodeName": node,
        }
        self._status(ENTITLEMENTS, obj, status)
        if old.get("state") != state:
            kind = "Warning" if state in ("Degraded", "Invalid") else "Normal"
            self.kube.create(
                EVENTS, obj["metadata"]["namespace"], o.event(obj, state, why, now, kind)
            )

    # -- helpers ------------------------------------------------------------------------

    def _status(self, kind: Any, obj: Any, status: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.kube.patch(kind, meta["namespace"], meta["name"], {"status": status}, sub="status")

    def _finalizer(self, kind: Any, obj: Any) -> None:
        finalizers = obj["metadata"].get("finalizers") or []
        if o.FINALIZER not in finalizers:
            meta = obj["metadata"]
            patch = {"metadata": {"finalizers": [*finalizers, o.FINALIZER]}}
            self.kube.patch(kind, meta["namespace"], meta["name"], patch)

    def _drop_finalizer(self, kind: Any, obj: Any) -> None:
        meta = obj["metadata"]
        rest = [f for f in meta.get("finalizers") or [] if f != o.FINALIZER]
        self.kube.patch(kind, meta["namespace"], meta["name"], {"metadata": {"finalizers": rest}})


def _requests(pod: Mapping[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in pod["spec"].get("containers", []):
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            if k.startswith("tokenpools.io/"):
                out[k] = out.get(k, 0) + int(v)
    return out


def _key(pod: Mapping[str, Any]) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def _started(pod: Mapping[str, Any]) -> int:
    start = (pod.get("status") or {}).get("startTime")
    return int(o.parse_time(start)) if start else 0


def _unschedulable(pod: Any) -> str | None:
    for cond in ((pod or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("message") or cond.get("reason"))
    return None
