"""A stand-in for kube-scheduler: what the design relies on from it, and nothing more.

- NodeResourcesFit on integer extended resources against `status.allocatable` (and
  `allocatable.pods`), counting every pod bound to the node, terminating ones included;
- TaintToleration (NoSchedule, NoExecute) and the pod's nodeSelector, on Ready nodes;
- the scheduling queue: higher priority first, then FIFO by the time the pod was queued;
- DefaultPreemption's PostFilter: on a node where the pod fits once every lower-priority pod
  is gone, the victims are the lower-priority pods left after reprieving as many as possible
  in order of importance (higher priority, then older); equal priority is never preempted;
  `preemptionPolicy: Never` waits. The node with the fewest, least important victims wins.

Pure functions over small dataclasses; tests/kube/cluster.py drives it over HTTP. It imports
nothing from tokenpools: it is an independent statement of the Kubernetes rules, so comparing
it with the core's `bind()` can find a disagreement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SNode:
    name: str
    allocatable: Mapping[str, int]
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()
    ready: bool = True


@dataclass(frozen=True)
class SPod:
    name: str
    priority: int
    requests: Mapping[str, int]
    queued: int  # when it entered the scheduling queue
    preempts: bool = True
    tolerations: Sequence[Mapping[str, str]] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    node: str | None = None
    started: int = 0  # when it was bound
    terminating: bool = False


@dataclass(frozen=True)
class Bind:
    pod: str
    node: str


@dataclass(frozen=True)
class Preempt:
    pod: str
    node: str
    victims: tuple[str, ...]


def _tolerates(pod: SPod, taint: Mapping[str, str]) -> bool:
    for tol in pod.tolerations:
        if tol.get("effect") not in (None, "", taint.get("effect")):
            continue
        if tol.get("operator") == "Exists" and tol.get("key") in (None, "", taint.get("key")):
            return True
        if tol.get("key") == taint.get("key") and tol.get("value", "") == taint.get("value", ""):
            return True
    return False


def _eligible(pod: SPod, node: SNode) -> bool:
    if not node.ready:
        return False
    if any(node.labels.get(k) != v for k, v in pod.node_selector.items()):
        return False
    hard = [t for t in node.taints if t.get("effect") in ("NoSchedule", "NoExecute")]
    return all(_tolerates(pod, t) for t in hard)


def _fits(pod: SPod, node: SNode, on_node: Sequence[SPod]) -> bool:
    """NodeResourcesFit: for each resource the pod requests, what the node's pods request
    plus this pod's is at most the allocatable (a resource the node lacks has 0)."""
    if len(on_node) >= node.allocatable.get("pods", 0):
        return False
    for name, want in pod.requests.items():
        if want <= 0:
            continue
        used = sum(other.requests.get(name, 0) for other in on_node)
        if used + want > node.allocatable.get(name, 0):
            return False
    return True


def schedule_one(pod: SPod, nodes: Sequence[SNode], pods: Sequence[SPod]) -> Bind | Preempt | None:
    """One scheduling attempt of a pending pod: bind, preempt, or stay unschedulable."""
    candidates = [n for n in nodes if _eligible(pod, n)]
    for node in candidates:
        if _fits(pod, node, [p for p in pods if p.node == node.name]):
            return Bind(pod.name, node.name)
    if not pod.preempts:
        return None
    best: Preempt | None = None
    best_key: tuple[int, int] | None = None
    for node in candidates:
        on_node = [p for p in pods if p.node == node.name]
        if any(p.terminating and p.priority < pod.priority for p in on_node):
            return None  # victims of an earlier preemption are still going: wait for them
        lower = [p for p in on_node if p.priority < pod.priority and not p.terminating]
        kept = [p for p in on_node if p not in lower]
        if not _fits(pod, node, kept):
            continue
        victims = []
        for p in sorted(lower, key=lambda p: (-p.priority, p.started, p.name)):
            if _fits(pod, node, [*kept, p]):
                kept.append(p)  # reprieved
            else:
                victims.append(p)
        if not victims:
            continue
        key = (max(v.priority for v in victims), len(victims))
        if best_key is None or key < best_key:
            best, best_key = Preempt(pod.name, node.name, tuple(v.name for v in victims)), key
    return best


def queue_order(pods: Sequence[SPod]) -> list[SPod]:
    pending = [p for p in pods if p.node is None and not p.terminating]
    return sorted(pending, key=lambda p: (-p.priority, p.queued, p.name))
