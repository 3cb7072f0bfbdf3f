"""The operator end to end over real HTTP: the official client against the API server
stand-in, with the kube-scheduler stand-in binding and preempting lease pods."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.kube.apiserver import ServerThread
from tests.kube.cluster import Scheduler
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import (
    ENTITLEMENTS,
    EVENTS,
    LEASES,
    NODES,
    PODS,
    POOLS,
    PRIORITY_CLASSES,
    Kind,
    Kube,
)
from tokenpools.k8s.reconciler import Reconciler

NS = "tenants"
DEPLOYMENTS = Kind("apps/v1", "deployments")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cluster() -> Iterator[tuple[Kube, Reconciler, Scheduler, Clock]]:
    server = ServerThread().start()
    cfg = client.Configuration()
    cfg.host = server.url
    kube = Kube(client.ApiClient(cfg))
    for pc in o.priority_classes():
        kube.create(PRIORITY_CLASSES, None, pc)
    clock = Clock()
    yield kube, Reconciler(kube, clock), Scheduler(server, kube), clock
    server.stop()


def pool(name: str = "qwen", replicas: int = 2, **extra: Any) -> dict[str, Any]:
    spec = {
        "model": "Qwen3-8B",
        "replicas": replicas,
        "maxReplicas": 4,
        "perReplica": {"tokensPerSecond": 240, "kvTokens": 16384, "concurrency": 8},
        **extra,
    }
    return {
        "apiVersion": "tokenpools.io/v1alpha1",
        "kind": "TokenPool",
        "metadata": {"name": name},
        "spec": spec,
    }


def ent(name: str, cls: str, slots: float, **extra: Any) -> dict[str, Any]:
    spec = {"tenantId": name, "pool": "qwen", "serviceClass": cls, "concurrency": slots, **extra}
    return {
        "apiVersion": "tokenpools.io/v1alpha1",
        "kind": "TokenEntitlement",
        "metadata": {"name": name},
        "spec": spec,
    }


def settle(rec: Reconciler, sched: Scheduler) -> None:
    for _ in range(4):  # reconcile → schedule → kubelet finalizes victims → schedule again
        rec.reconcile()
        sched.run()
    rec.reconcile()


def states(kube: Kube) -> dict[str, str]:
    return {e["metadata"]["name"]: e["status"]["state"] for e in kube.list(ENTITLEMENTS, NS)}


def test_pool_entitlements_preemption_shrink_and_cleanup(cluster: Any) -> None:
    kube, rec, sched, clock = cluster
    kube.create(POOLS, NS, pool())
    for obj in (ent("gold", "guaranteed", 8), ent("chat", "elastic", 12), ent("batch", "spot", 6)):
        kube.create(ENTITLEMENTS, NS, obj)
    settle(rec, sched)

    node = kube.get(NODES, None, o.node_name(NS, "qwen"))
    alloc = node["status"]["allocatable"]
    assert alloc["tokenpools.io/concurrency"] == "16"
    assert alloc["tokenpools.io/shared-concurrency"] == "24"
    assert alloc["tokenpools.io/tokens-per-second"] == "480" and int(alloc["pods"]) > 0
    assert node["spec"]["taints"] == [o.TAINT]
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["True"]
    assert states(kube) == {"gold": "Bound", "chat": "Bound", "batch": "Bound"}
    pods = {p["metadata"]["name"]: p for p in kube.list(PODS, NS)}
    gold = pods["lease-gold"]
    res = gold["spec"]["containers"][0]["resources"]
    assert res["requests"] == res["limits"] and res["requests"]["tokenpools.io/concurrency"] == "8"
    assert gold["spec"]["priorityClassName"] == "tokenpools-guaranteed"
    assert gold["metadata"]["ownerReferences"][0]["kind"] == "TokenEntitlement"
    assert gold["status"]["phase"] == "Running"
    assert (
        "tokenpools.io/concurrency"
        not in pods["lease-batch"]["spec"]["containers"][0]["resources"]["requests"]
    )

    # A second guaranteed tenant: 16 reserved slots fit, but 8 + 8 + 12 shared > 24, so the
    # scheduler preempts the elastic lease pod, which turns Degraded.
    kube.create(ENTITLEMENTS, NS, ent("gold2", "guaranteed", 8))
    settle(rec, sched)
    assert states(kube) == {"gold": "Bound", "chat": "Degraded", "batch": "Bound", "gold2": "Bound"}
    assert any(
        e["reason"] == "Degraded" and e["involvedObject"]["name"] == "chat"
        for e in kube.list(EVENTS, NS)
    )

    # One replica lost: the older guaranteed lease stays, the newer one is evicted.
    kube.patch(POOLS, NS, "qwen", {"spec": {"replicas": 1}})
    settle(rec, sched)
    assert states(kube) == {
        "gold": "Bound",
        "chat": "Degraded",
        "batch": "Bound",
        "gold2": "Degraded",
    }
    assert (
        kube.get(NODES, None, o.node_name(NS, "qwen"))["status"]["allocatable"][
            "tokenpools.io/concurrency"
        ]
        == "8"
    )

    # The operator restarts: nothing is duplicated, nothing changes.
    before = sorted(p["metadata"]["name"] for p in kube.list(PODS, NS))
    settle(Reconciler(kube, clock), sched)
    assert sorted(p["metadata"]["name"] for p in kube.list(PODS, NS)) == before
    assert len(kube.list(NODES)) == 1

    # Deleting an entitlement removes its lease pod (finalizer), then the CR itself.
    kube.delete(ENTITLEMENTS, NS, "gold2")
    settle(rec, sched)
    assert (
        kube.find(PODS, NS, "lease-gold2") is None and kube.find(ENTITLEMENTS, NS, "gold2") is None
    )

    # Deleting the pool removes its node and node Lease.
    kube.delete(POOLS, NS, "qwen")
    rec.reconcile()
    assert kube.find(POOLS, NS, "qwen") is None
    assert kube.find(NODES, None, o.node_name(NS, "qwen")) is None
    assert kube.find(LEASES, o.NODE_LEASE_NAMESPACE, o.node_name(NS, "qwen")) is None


def test_heartbeat_renews_the_node_condition_and_lease(cluster: Any) -> None:
    kube, rec, _, clock = cluster
    kube.create(POOLS, NS, pool())
    rec.reconcile()
    name = o.node_name(NS, "qwen")
    first = kube.get(LEASES, o.NODE_LEASE_NAMESPACE, name)["spec"]
    assert first["holderIdentity"] == name and first["leaseDurationSeconds"] == 40
    clock.now += 10
    rec.heartbeat()
    lease = kube.get(LEASES, o.NODE_LEASE_NAMESPACE, name)["spec"]
    assert o.parse_time(lease["renewTime"]) - o.parse_time(first["renewTime"]) == pytest.approx(10)
    ready = [c for c in kube.get(NODES, None, name)["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["lastHeartbeatTime"] == o.iso(clock.now)


def test_autoscaling_writes_the_scale_within_bounds_with_a_cooldown(cluster: Any) -> None:
    kube, rec, sched, clock = cluster
    deploy = {
        "metadata": {"name": "vllm"},
        "spec": {"replicas": 1},
        "status": {"replicas": 1, "readyReplicas": 1},
    }
    kube.create(DEPLOYMENTS, NS, deploy)
    target = {
        "scaleTargetRef": {"name": "vllm"},
        "autoscaling": {"cooldownS": 60},
        "minReplicas": 1,
    }
    kube.create(POOLS, NS, pool(replicas=1, **target))
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 8))
    kube.create(ENTITLEMENTS, NS, ent("gold2", "guaranteed", 8))
    settle(rec, sched)
    # 16 reserved slots on one ready 8-slot replica: one lease pod waits, two replicas wanted
    assert sorted(states(kube).values()) == ["Bound", "Pending"]
    assert kube.get(DEPLOYMENTS, NS, "vllm")["spec"]["replicas"] == 2
    scaled = [e for e in kube.list(EVENTS, NS) if e["reason"] == "Scaled"]
    assert len(scaled) == 1 and "from 1 to 2" in scaled[0]["message"]

    # More demand than maxReplicas allows: clamped at 4, and only after the cooldown.
    for i in range(5):
        kube.create(ENTITLEMENTS, NS, ent(f"more{i}", "guaranteed", 8))
    clock.now += 30
    settle(rec, sched)
    assert kube.get(DEPLOYMENTS, NS, "vllm")["spec"]["replicas"] == 2
    clock.now += 31
    settle(rec, sched)
    assert kube.get(DEPLOYMENTS, NS, "vllm")["spec"]["replicas"] == 4

    # The node follows the replicas that are ready, not the ones asked for.
    node = o.node_name(NS, "qwen")
    assert kube.get(NODES, None, node)["status"]["allocatable"]["tokenpools.io/concurrency"] == "8"
    kube.patch(DEPLOYMENTS, NS, "vllm", {"status": {"readyReplicas": 3}}, sub="status")
    settle(rec, sched)
    assert kube.get(NODES, None, node)["status"]["allocatable"]["tokenpools.io/concurrency"] == "24"
    assert list(states(kube).values()).count("Bound") == 3


def test_expired_and_invalid_entitlements(cluster: Any) -> None:
    kube, rec, sched, _ = cluster
    kube.create(POOLS, NS, pool())
    kube.create(ENTITLEMENTS, NS, ent("old", "guaranteed", 2, expiresAt="2020-01-01T00:00:00Z"))
    kube.create(ENTITLEMENTS, NS, ent("bad", "guaranteed", -3))
    kube.create(ENTITLEMENTS, NS, ent("lost", "elastic", 2, pool="nope"))
    settle(rec, sched)
    got = {e["metadata"]["name"]: e["status"] for e in kube.list(ENTITLEMENTS, NS)}
    assert got["old"]["state"] == "Expired" and kube.find(PODS, NS, "lease-old") is None
    assert got["bad"]["state"] == "Invalid" and "concurrency" in got["bad"]["message"]
    assert got["lost"]["state"] == "Invalid" and "unknown pool" in got["lost"]["message"]


def test_the_gateway_takes_the_binding_the_operator_wrote(cluster: Any) -> None:
    import base64

    from tokenpools.control.core import DecisionCore
    from tokenpools.control.decisions import Admit, Reject
    from tokenpools.k8s.api import SECRETS
    from tokenpools.k8s.source import ClusterSource
    from tokenpools.model.request import RequestCost
    from tokenpools.state.memory import MemoryStore

    kube, rec, sched, _ = cluster
    kube.create(POOLS, NS, pool(replicas=2))
    secret = {
        "metadata": {"name": "keys"},
        "data": {"apiKeys": base64.b64encode(b"sk-gold\n").decode()},
    }
    kube.create(SECRETS, NS, secret)
    refs = {"apiKeySecretRefs": [{"name": "keys"}]}
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 6, **refs))
    kube.create(ENTITLEMENTS, NS, ent("chat", "elastic", 14))
    settle(rec, sched)
    kube.create(ENTITLEMENTS, NS, ent("gold2", "guaranteed", 6))
    settle(rec, sched)  # 6 + 6 + 14 shared > 24: chat is preempted
    assert states(kube) == {"gold": "Bound", "chat": "Degraded", "gold2": "Bound"}

    source = ClusterSource(kube, NS, {}).start()
    core = DecisionCore(source.config(), MemoryStore(), now=0.0)
    source.stop()
    assert core.entitlement_for_key("sk-gold") == "gold"
    cost = RequestCost(input_tokens=64, max_output_tokens=64)
    assert isinstance(core.admit("gold", cost, now=0.0), Admit)
    refused = core.admit("chat", cost, now=0.0)
    assert isinstance(refused, Reject) and refused.reason == "entitlement_degraded"


def test_serve_kubernetes_follows_the_cluster_over_http(cluster: Any) -> None:
    import base64

    import httpx

    from tests.gateway_setup import FAST
    from tests.servers import ServerThread as HttpServer
    from tests.servers import wait_until
    from tokenpools.emulator.server import make_app as make_emulator
    from tokenpools.gateway.server import build_kubernetes
    from tokenpools.k8s.api import SECRETS

    kube, rec, sched, _ = cluster
    emulator = HttpServer(make_emulator(FAST, speed=1.0))
    backends = {"backends": [{"url": emulator.url}], "servedModels": ["qwen3-8b"]}
    kube.create(POOLS, NS, pool(replicas=2, **backends))
    for who in ("gold", "chat"):
        keys = base64.b64encode(f"sk-{who}\n".encode()).decode()
        kube.create(SECRETS, NS, {"metadata": {"name": who}, "data": {"apiKeys": keys}})
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 6, apiKeySecretRefs=[{"name": "gold"}]))
    kube.create(ENTITLEMENTS, NS, ent("chat", "elastic", 14, apiKeySecretRefs=[{"name": "chat"}]))
    settle(rec, sched)
    kube.create(ENTITLEMENTS, NS, ent("gold2", "guaranteed", 6))
    settle(rec, sched)
    assert states(kube)["chat"] == "Degraded"

    gateway = HttpServer(build_kubernetes(kube, NS, {}))
    body = {"model": "qwen3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    def ask(who: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer sk-{who}"}
        return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers)

    try:
        assert ask("gold").status_code == 200
        refused = ask("chat")
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        assert refused.json()["error"]["code"] == "entitlement_degraded"
        # The scheduler's decision changes (gold2 leaves, chat binds): the gateway follows.
        kube.delete(ENTITLEMENTS, NS, "gold2")
        settle(rec, sched)
        assert states(kube)["chat"] == "Bound"
        wait_until(lambda: ask("chat").status_code == 200)
    finally:
        gateway.stop()
        emulator.stop()


def test_an_informer_follows_creates_changes_and_deletes(cluster: Any) -> None:
    import threading

    from tests.servers import wait_until
    from tokenpools.k8s.informer import Informer

    kube, _, _, _ = cluster
    kube.create(POOLS, NS, pool("before"))
    kube.create(POOLS, "elsewhere", pool("other-namespace"))
    changes = threading.Semaphore(0)
    informer = Informer(kube, POOLS, NS, changes.release, watch_timeout_s=1).start()
    try:
        assert informer.synced.wait(10)
        assert [p["metadata"]["name"] for p in informer.items()] == ["before"]
        kube.create(POOLS, NS, pool("after"))
        kube.patch(POOLS, NS, "before", {"spec": {"replicas": 3}})
        wait_until(lambda: len(informer.items()) == 2)
        wait_until(lambda: {p["metadata"]["name"]: p["spec"]["replicas"] for p in informer.items()}
                   == {"before": 3, "after": 2})  # fmt: skip
        kube.delete(POOLS, NS, "after")
        wait_until(lambda: [p["metadata"]["name"] for p in informer.items()] == ["before"])
        # the watch stream ends every second; the informer resumes it without listing again
        lists = _pool_requests(cluster).count("list")
        wait_until(lambda: _pool_requests(cluster).count("watch") >= 3)
        assert _pool_requests(cluster).count("list") == lists == 1
    finally:
        informer.stop()


def _pool_requests(cluster: Any) -> list[str]:
    """ "list" or "watch", for each GET of the namespace's TokenPools the server has seen."""
    server = cluster[2].server
    path = f"/namespaces/{NS}/tokenpools"
    gets = [r for r in list(server.api) if r.url.path.endswith(path) and r.method == "GET"]
    return ["watch" if r.params.get("watch") == "true" else "list" for r in gets]
