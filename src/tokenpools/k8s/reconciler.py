"""The operator's level-triggered reconciliation, one object at a time.

Each pass reads the TokenPools, TokenEntitlements, lease pods and namespaces (label-scoped,
paged), builds the config from them once (k8s/custom_resources.py keeps each problem with its
object), then reconciles every pool (its virtual node, the node's kubelet duties, autoscaling)
and every entitlement (its lease pods and state) on its own. A failed API call fails only that
object: it gets a `Reconciled=False` condition and an Event naming the API error, and is tried
again after an exponential backoff (k8s/retries.py), while every other object and the nodes'
heartbeats (a separate schedule, k8s/virtual_node.py) go on. A pool's llm-d
InferenceObjectives are part of the pool (k8s/objective_sync.py). Writes happen only when
something changed, so the loop settles. The clock is injected; all I/O goes through `Kube`."""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

from tokenpools.control.autoscale import baseline_need, desired_replicas
from tokenpools.control.node_capacity import Advertised, advertise
from tokenpools.control.placement import pool_allocatable
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import (
    BUDGETS,
    ENTITLEMENTS,
    EVENTS,
    NAMESPACES,
    NODES,
    PODS,
    POOLS,
    Kube,
    workload_kind,
)
from tokenpools.k8s.applied import ClusterConfig
from tokenpools.k8s.custom_resources import config_data
from tokenpools.k8s.errors import describe
from tokenpools.k8s.grace import DEFAULT_GRACE_S, REVOKING, Grace
from tokenpools.k8s.lease_pods import LeasePods
from tokenpools.k8s.names import label_value
from tokenpools.k8s.objective_sync import ObjectiveSync
from tokenpools.k8s.operator_metrics import OperatorMetrics
from tokenpools.k8s.retries import Retries
from tokenpools.k8s.status import Condition, conditions, spec_accepted, write_status
from tokenpools.k8s.virtual_node import NodeConflict, VirtualNodes
from tokenpools.model.config import Config, parse_config

log = logging.getLogger("tokenpools.operator")


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        clock: Callable[[], float],
        namespace: str = "tokenpools-system",
        metrics: OperatorMetrics | None = None,
        installation: str | None = None,
        binding_grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        self.kube, self.clock, self.namespace = kube, clock, namespace  # the platform's
        self.binding_grace_s = binding_grace_s  # how long a closed pool leaves a binding
        self.installation = o.installation_id(installation, namespace)  # whose nodes are ours
        self.metrics = metrics or OperatorMetrics(clock)
        self.nodes = VirtualNodes(kube, clock, self.metrics, self.installation)
        self.lease_pods = LeasePods(kube, clock, self.installation)
        self.objectives = ObjectiveSync(kube, namespace)
        self.retries = Retries(kube, clock, self.metrics, namespace)

    def heartbeat(self) -> int:
        return self.nodes.heartbeat()

    def reconcile(self) -> None:
        pools = self.kube.list(POOLS)
        ents = self.kube.list(ENTITLEMENTS)
        labels = {n["metadata"]["name"]: n["metadata"].get("labels") or {}
                  for n in self.kube.list(NAMESPACES)}  # fmt: skip
        owned: dict[str, list[Any]] = defaultdict(list)
        for pod in self.kube.list(PODS, labels={o.LEASE_LABEL: "true"}):
            owned[o.owner_uid(pod) or ""].append(pod)
        budgets = self.kube.list(BUDGETS)
        grace = Grace(self.clock(), self.binding_grace_s)
        cluster = config_data(pools, ents, labels, budgets=budgets, grace=grace)
        config = parse_config(cluster.data)  # each object's problems are already set aside
        live = {e["metadata"]["uid"]: e["metadata"]["name"] for e in ents
                if not e["metadata"].get("deletionTimestamp")}  # fmt: skip
        self.objectives.begin()
        for obj in pools:
            self.retries.run("TokenPool", obj, partial(self._pool, obj, cluster, config, live))
        states: Counter[str] = Counter()
        for obj in ents:
            mine = owned.get(obj["metadata"]["uid"], [])
            step = partial(self._entitlement, obj, cluster, config, mine)
            states.update([self.retries.run("TokenEntitlement", obj, step) or "Error"])
        for obj in budgets:
            self.retries.run("TokenBudget", obj, partial(self._budget, obj, cluster))
        for state in ("Bound", "Pending", "Degraded", "Expired", "Invalid"):
            self.metrics.lease_pods.labels(state).set(states[state])
        self._forget_orphan_nodes({p["metadata"]["name"] for p in pools})
        self._forget_orphan_objectives(pools)

    # -- pools: the virtual node, its kubelet duties, autoscaling ---------------------

    def _pool(self, obj: Any, cluster: ClusterConfig, config: Config, live: dict[str, str]) -> None:
        name = obj["metadata"]["name"]
        if obj["metadata"].get("deletionTimestamp"):
            self.nodes.remove(name)
            self._drop_finalizer(POOLS, obj)
            log.info("pool %s deleted: its node removed", name)
            return
        self._finalizer(POOLS, obj)
        where = ("TokenPool", "", name)
        gen, old = obj["metadata"].get("generation", 1), obj.get("status") or {}
        if not cluster.in_force(where):
            why = cluster.problems[where]
            conds = [Condition("Ready", False, "Invalid", why), spec_accepted(cluster, where, why)]
            merged = conditions(old.get("conditions"), conds, self.clock(), gen)
            write_status(self.kube, POOLS, obj, {"observedGeneration": gen, "conditions": merged})
            return
        pool, extras = config.pools[name], cluster.pool_extras[name]
        ready, asked = self._replicas(pool.replicas, extras)
        since = old.get("shrinkPendingSince")
        before = (
            None
            if "replicas" not in old
            else Advertised(int(old["replicas"]), None if since is None else o.parse_time(since))
        )
        # the workload's readiness can dip and come back; the spec's replicas are a decision
        hold = extras.capacityShrinkAfterS if extras.scaleTargetRef is not None else 0.0
        shown = advertise(before, ready, self.clock(), hold)
        alloc = pool_allocatable(
            pool.with_replicas(shown.replicas), config.policy.elastic_oversubscription
        )
        message = f"{shown.replicas} replicas of {pool.per_replica}"
        try:
            node = self.nodes.ensure(name, alloc, message)
        except NodeConflict as conflict:
            self._node_conflict(obj, cluster, conflict)
            self.objectives.sync(obj, extras.inferencePoolRef)
            return
        self.nodes.kubelet(node, alloc, live)
        members = [e for e in config.entitlements.values() if e.pool == name]
        desired = desired_replicas(pool, baseline_need(members))
        self.metrics.desired.labels(name).set(desired)
        status: dict[str, Any] = {
            "nodeName": node,
            "replicas": shown.replicas,
            "readyReplicas": ready,
            "shrinkPendingSince": None if shown.dip_since is None else o.iso(shown.dip_since),
            "desiredReplicas": desired,
            "capacity": alloc,
            "observedGeneration": gen,
            "appliedSpec": cluster.applied[where],
        }
        writes = extras.autoscaling.mode == "write" and extras.scaleTargetRef is not None
        if writes and desired != asked:
            status |= self._scale(obj, extras, asked, desired)
        conds = [
            Condition("Ready", True, "NodeReady", message),
            spec_accepted(cluster, where),
            _revoking(cluster, name),
        ]
        status["conditions"] = conditions(old.get("conditions"), conds, self.clock(), gen)
        write_status(self.kube, POOLS, obj, status)
        # last: the node and status above stand even when the objectives' API fails
        self.objectives.sync(obj, extras.inferencePoolRef)

    def _node_conflict(self, obj: Any, cluster: ClusterConfig, conflict: NodeConflict) -> None:
        """The pool's node name is someone else's Node: nothing is written to it or bound to
        it (lease pods select this installation's node), and the pool says so."""
        where = ("TokenPool", "", obj["metadata"]["name"])
        gen, old = obj["metadata"].get("generation", 1), obj.get("status") or {}
        was = {c.get("type"): c.get("reason") for c in old.get("conditions") or []}
        why = str(conflict)
        conds = [Condition("Ready", False, "NodeConflict", why), spec_accepted(cluster, where)]
        status = {
            "nodeName": None,
            "observedGeneration": gen,
            "appliedSpec": cluster.applied[where],
            "conditions": conditions(old.get("conditions"), conds, self.clock(), gen),
        }
        write_status(self.kube, POOLS, obj, status)
        if was.get("Ready") != "NodeConflict":
            log.warning("pool %s: %s", where[2], why)
            event = o.event(obj, "NodeConflict", why, self.clock(), "Warning")
            self.kube.create(EVENTS, self.namespace, event)

    def _replicas(self, replicas: int, extras: Any) -> tuple[int, int]:
        """(ready replicas, replicas asked for): the workload's, else the spec's. A workload
        whose status has no `readyReplicas` has none ready (the API server omits zeros)."""
        ref = extras.scaleTargetRef
        if ref is None:
            return replicas, replicas
        workload = self.kube.find(workload_kind(ref.apiVersion, ref.kind), self.namespace, ref.name)
        if workload is None:
            return 0, 0
        asked = int(workload.get("spec", {}).get("replicas", 0))
        return int((workload.get("status") or {}).get("readyReplicas") or 0), asked

    def _scale(self, obj: Any, extras: Any, current: int, desired: int) -> dict[str, Any]:
        now = self.clock()
        last = (obj.get("status") or {}).get("lastScaleTime")
        if last is not None and now - o.parse_time(last) < extras.autoscaling.cooldownS:
            return {"lastScaleTime": last}
        ref = extras.scaleTargetRef
        kind = workload_kind(ref.apiVersion, ref.kind)
        self.kube.patch(
            kind, self.namespace, ref.name, {"spec": {"replicas": desired}}, sub="scale"
        )
        self.metrics.scale_writes.labels(obj["metadata"]["name"]).inc()
        why = (
            f"scaled {ref.kind}/{ref.name} from {current} to {desired} replicas: the reserved "
            f"and elastic baselines of the pool's entitlements need {desired}"
        )
        self.kube.create(EVENTS, self.namespace, o.event(obj, "Scaled", why, now))
        log.info("pool %s: %s", obj["metadata"]["name"], why)
        return {"lastScaleTime": o.iso(now)}

    def _forget_orphan_objectives(self, pools: list[Any]) -> None:
        """Best-effort: a failure is tried again next pass, and the garbage collector removes
        them through their owner reference anyway."""
        live = {p["metadata"]["name"] for p in pools if not p["metadata"].get("deletionTimestamp")}
        try:
            self.objectives.forget(live)
        except Exception as exc:
            self.metrics.errors.labels("InferenceObjective", describe(exc)[0]).inc()
            log.warning("deleting InferenceObjectives of deleted pools: %s", describe(exc)[1])

    def _forget_orphan_nodes(self, pools: set[str]) -> None:
        wanted = {label_value(p) for p in pools}
        for node in self.nodes.nodes():
            if node["metadata"]["labels"][o.POOL_LABEL] not in wanted:
                self.kube.delete(NODES, None, node["metadata"]["name"])

    # -- budgets: applied (the gateways take them from status) or refused ----------------

    def _budget(self, obj: Any, cluster: ClusterConfig) -> None:
        where = ("TokenBudget", "", obj["metadata"]["name"])
        gen, old = obj["metadata"].get("generation", 1), obj.get("status") or {}
        status: dict[str, Any] = {"observedGeneration": gen}
        if cluster.in_force(where):
            conds = [
                Condition("Ready", True, "Applied", "in force at the gateways"),
                spec_accepted(cluster, where),
            ]
            status["appliedSpec"] = cluster.applied[where]
        else:
            why = cluster.problems.get(where, "not applied")
            conds = [Condition("Ready", False, "Invalid", why), spec_accepted(cluster, where, why)]
        status["conditions"] = conditions(old.get("conditions"), conds, self.clock(), gen)
        write_status(self.kube, BUDGETS, obj, status)

    # -- entitlements -------------------------------------------------------------------

    def _entitlement(
        self, obj: Any, cluster: ClusterConfig, config: Config, pods: list[Any]
    ) -> str:
        if obj["metadata"].get("deletionTimestamp"):
            self.lease_pods.finalize(pods)
            self._drop_finalizer(ENTITLEMENTS, obj)
            return "Deleted"
        self._finalizer(ENTITLEMENTS, obj)
        return self.lease_pods.reconcile(obj, cluster, config, pods)

    # -- finalizers -----------------------------------------------------------------------

    def _finalizer(self, kind: Any, obj: Any) -> None:
        finalizers = obj["metadata"].get("finalizers") or []
        if o.FINALIZER not in finalizers:
            meta = obj["metadata"]
            patch = {"metadata": {"finalizers": [*finalizers, o.FINALIZER]}}
            self.kube.patch(kind, meta.get("namespace"), meta["name"], patch)

    def _drop_finalizer(self, kind: Any, obj: Any) -> None:
        meta = obj["metadata"]
        rest = [f for f in meta.get("finalizers") or [] if f != o.FINALIZER]
        self.kube.patch(
            kind, meta.get("namespace"), meta["name"], {"metadata": {"finalizers": rest}}
        )


def _revoking(cluster: ClusterConfig, pool: str) -> Condition:
    """The pool's Revoking condition: its Bound entitlements it no longer admits, kept for the
    grace period (k8s/grace.py), and when the first of them loses its binding."""
    risks = sorted(
        (deadline, f"{where[1]}/{where[2]}")
        for where, (_, deadline) in cluster.at_risk.items()
        if cluster.applied[where].get("pool") == pool
    )
    if not risks:
        return Condition(REVOKING, False, "InForce", "every Bound entitlement is admitted")
    names = ", ".join(name for _, name in risks)
    return Condition(
        REVOKING,
        True,
        "PoolClosed",
        f"{len(risks)} Bound entitlements are no longer admitted ({names}); the first loses "
        f"its binding at {o.iso(risks[0][0])} unless the pool is opened to them again",
    )
