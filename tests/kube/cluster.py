"""Drives the scheduler stand-in over HTTP, as kube-scheduler would: admission fills each
pod's priority from its PriorityClass (the API server's job, which the stand-in server lacks),
then pending pods bind through `pods/NAME/binding` or preempt victims, which are deleted
gracefully and marked with a DisruptionTarget condition."""

from __future__ import annotations

from typing import Any

from tests.kube.apiserver import ServerThread
from tests.kube.scheduler import Bind, Preempt, SNode, SPod, queue_order, schedule_one
from tokenpools.k8s.api import NODES, PODS, PRIORITY_CLASSES, Kube
from tokenpools.k8s.quantity import parse


def quantity(resource: str, text: str) -> int:
    """A resource.Quantity as the scheduler compares it: cpu in millicores, anything else in
    whole units (memory in bytes), so "1" cpu and "1000m" are equal."""
    return int(parse(text) * (1000 if resource == "cpu" else 1))


def _node(obj: dict[str, Any]) -> SNode:
    status = obj.get("status") or {}
    alloc = {k: quantity(k, v) for k, v in (status.get("allocatable") or {}).items()}
    ready = any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
    )
    meta = obj["metadata"]
    return SNode(
        meta["name"], alloc, meta.get("labels") or {}, obj["spec"].get("taints") or [], ready
    )


def _pod(obj: dict[str, Any], seq: dict[tuple[str | None, str], int]) -> SPod:
    spec, meta = obj["spec"], obj["metadata"]
    requests: dict[str, int] = {}
    for c in spec.get("containers", []):
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            requests[k] = requests.get(k, 0) + quantity(k, v)
    key = (meta["namespace"], meta["name"])
    return SPod(
        meta["name"],
        int(spec.get("priority") or 0),
        requests,
        seq.get(key, 0),
        spec.get("preemptionPolicy") != "Never",
        spec.get("tolerations") or [],
        spec.get("nodeSelector") or {},
        spec.get("nodeName"),
        seq.get(key, 0),
        bool(meta.get("deletionTimestamp")),
    )


class Scheduler:
    def __init__(self, server: ServerThread, kube: Kube) -> None:
        self.server, self.kube = server, kube

    def admit(self) -> None:
        classes = {pc["metadata"]["name"]: pc for pc in self.kube.list(PRIORITY_CLASSES)}
        for pod in self.kube.list(PODS):
            spec = pod["spec"]
            pc = classes.get(spec.get("priorityClassName", ""))
            if pc is not None and "priority" not in spec:
                # admission sets these at creation; patching them is the stand-in's shortcut
                self.server.call(self._set(pod, pc))

    async def _set(self, pod: dict[str, Any], pc: dict[str, Any]) -> None:
        stored = self.server.api.store[("v1", "pods")][
            (pod["metadata"]["namespace"], pod["metadata"]["name"])
        ]
        stored["spec"]["priority"] = pc["value"]
        stored["spec"]["preemptionPolicy"] = pc.get("preemptionPolicy", "PreemptLowerPriority")

    def run(self) -> list[Bind | Preempt]:
        """Scheduling cycles until nothing more binds or preempts."""
        self.admit()
        done: list[Bind | Preempt] = []
        while True:
            nodes = [_node(n) for n in self.kube.list(NODES)]
            by_name = {}
            for p in self.kube.list(PODS):
                by_name[p["metadata"]["name"]] = (p, _pod(p, self.server.api.sequence))
            pods = [sp for _, sp in by_name.values()]
            for pod in queue_order(pods):
                outcome = schedule_one(pod, nodes, pods)
                ns = by_name[pod.name][0]["metadata"]["namespace"]
                if isinstance(outcome, Bind):
                    body = {
                        "apiVersion": "v1",
                        "kind": "Binding",
                        "metadata": {"name": pod.name},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": outcome.node},
                    }
                    self.kube.request("POST", PODS.path(ns, pod.name, "binding"), body)
                elif isinstance(outcome, Preempt):
                    for victim in outcome.victims:
                        cond = {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "PreemptionByScheduler",
                        }
                        self.kube.patch(
                            PODS, ns, victim, {"status": {"conditions": [cond]}}, sub="status"
                        )
                        self.kube.delete(PODS, ns, victim)  # graceful: the kubelet finalizes
                    status = {"status": {"nominatedNodeName": outcome.node}}
                    self.kube.patch(PODS, ns, pod.name, status, sub="status")
                else:
                    cond = {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": f"0/{len(nodes)} nodes are available: insufficient resources",
                    }
                    self.kube.patch(
                        PODS, ns, pod.name, {"status": {"conditions": [cond]}}, sub="status"
                    )
                    continue
                done.append(outcome)
                break
            else:
                return done
