"""The operator's test bench: the API server stand-in, the scheduler stand-in, an injected
clock, and builders for the custom resources as a platform and its tenants write them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from tests.kube.apiserver import ServerThread
from tests.kube.cluster import Scheduler
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, NAMESPACES, PODS, PRIORITY_CLASSES, Kind, Kube
from tokenpools.k8s.names import label_value
from tokenpools.k8s.reconciler import Reconciler

NS = "tenants"
PLATFORM = "tokenpools-system"
TENANT_LABEL = {"tokenpools.io/tenant": "true"}
DEPLOYMENTS = Kind("apps/v1", "deployments")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Bench:
    server: ServerThread
    kube: Kube
    rec: Reconciler
    sched: Scheduler
    clock: Clock

    def settle(self, rec: Reconciler | None = None) -> None:
        rec = rec or self.rec
        for _ in range(4):  # reconcile → schedule → kubelet finalizes victims → schedule again
            rec.reconcile()
            self.sched.run()
        rec.reconcile()

    def states(self, ns: str = NS) -> dict[str, str]:
        return {
            e["metadata"]["name"]: (e.get("status") or {}).get("state", "")
            for e in self.kube.list(ENTITLEMENTS, ns)
        }

    def leases(self, name: str, ns: str = NS) -> list[Any]:
        """The lease pods of entitlement `name`."""
        return self.kube.list(PODS, ns, labels={o.ENTITLEMENT_LABEL: label_value(name)})

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        self.kube.create(NAMESPACES, None, {"metadata": {"name": name, "labels": labels or {}}})


def kube_for(server: ServerThread) -> Kube:
    cfg = client.Configuration()
    cfg.host = server.url
    return Kube(client.ApiClient(cfg))


@contextlib.contextmanager
def running_bench() -> Iterator[Bench]:
    server = ServerThread().start()
    try:
        kube = kube_for(server)
        for pc in o.priority_classes():
            kube.create(PRIORITY_CLASSES, None, pc)
        clock = Clock()
        b = Bench(server, kube, Reconciler(kube, clock, PLATFORM), Scheduler(server, kube), clock)
        b.namespace(PLATFORM)
        b.namespace(NS, TENANT_LABEL)
        yield b
    finally:
        server.stop()


@pytest.fixture
def bench() -> Iterator[Bench]:
    with running_bench() as b:
        yield b


def pool(name: str = "qwen", replicas: int = 2, **extra: Any) -> dict[str, Any]:
    spec = {
        "model": "Qwen3-8B",
        "replicas": replicas,
        "maxReplicas": 4,
        "perReplica": {"tokensPerSecond": 240, "kvTokens": 16384, "concurrency": 8},
        "namespaceSelector": {"matchLabels": TENANT_LABEL},
        "capacityShrinkAfterS": 0,
        **extra,
    }
    return {"apiVersion": "tokenpools.io/v1alpha1", "kind": "TokenPool",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def ent(name: str, cls: str, slots: float, **extra: Any) -> dict[str, Any]:
    spec = {"pool": "qwen", "serviceClass": cls, "concurrency": slots, **extra}
    return {"apiVersion": "tokenpools.io/v1alpha1", "kind": "TokenEntitlement",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def deployment_status(ready: int, replicas: int) -> dict[str, Any]:
    """As the Deployment controller writes it: a zero count is omitted, not written as 0."""
    status = {"replicas": replicas, "readyReplicas": ready, "availableReplicas": ready}
    return {"status": {k: v or None for k, v in status.items()}}  # None: removed (merge patch)
