"""The operator end to end over real HTTP: the official client against the API server
stand-in, with the kube-scheduler stand-in binding and preempting lease pods."""

from __future__ import annotations

import pytest

from tests.kube.api_faults import Fault
from tests.kube.harness import DEPLOYMENTS, NS, PLATFORM, Bench, bench, deployment_status, ent, pool
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, EVENTS, LEASES, NODES, POOLS
from tokenpools.k8s.names import node_name
from tokenpools.k8s.reconciler import Reconciler

__all__ = ["bench"]  # the fixture


def test_pool_entitlements_preemption_shrink_and_cleanup(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    for obj in (ent("gold", "guaranteed", 8), ent("chat", "elastic", 12), ent("batch", "spot", 6)):
        kube.create(ENTITLEMENTS, NS, obj)
    bench.settle()

    node = kube.get(NODES, None, node_name("qwen"))
    alloc = node["status"]["allocatable"]
    assert alloc["tokenpools.io/concurrency"] == "16"
    assert alloc["tokenpools.io/shared-concurrency"] == "24"
    assert alloc["tokenpools.io/tokens-per-second"] == "480" and int(alloc["pods"]) > 0
    assert node["spec"]["taints"] == [o.TAINT] and o.TAINT["effect"] == "NoExecute"
    assert node["metadata"]["labels"]["kubernetes.io/os"] == "linux"
    # cpu and memory: what its pods can request, not a fictitious 1,000 CPUs and 4 Ti
    assert (alloc["cpu"], alloc["memory"], alloc["pods"]) == ("500m", "2000Mi", "500")
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["True"]
    assert bench.states() == {"gold": "Bound", "chat": "Bound", "batch": "Bound"}
    [gold] = bench.leases("gold")
    res = gold["spec"]["containers"][0]["resources"]
    assert res["requests"] == res["limits"] and res["requests"]["tokenpools.io/concurrency"] == "8"
    assert gold["spec"]["priorityClassName"] == "tokenpools-guaranteed"
    assert gold["metadata"]["ownerReferences"][0]["kind"] == "TokenEntitlement"
    assert gold["status"]["phase"] == "Running"
    assert (res["requests"]["cpu"], res["requests"]["memory"]) == ("1m", "4Mi")  # for quotas
    keys = {(t["key"], t.get("effect")) for t in gold["spec"]["tolerations"]}
    assert (o.TAINT["key"], None) in keys  # every effect of the node's taint
    assert ("node.kubernetes.io/unreachable", "NoExecute") in keys
    assert ("node.kubernetes.io/not-ready", "NoExecute") in keys
    assert not any("tolerationSeconds" in t for t in gold["spec"]["tolerations"])
    [batch] = bench.leases("batch")
    assert (
        "tokenpools.io/concurrency" not in batch["spec"]["containers"][0]["resources"]["requests"]
    )

    # A second guaranteed tenant: 16 reserved slots fit, but 8 + 8 + 12 shared > 24, so the
    # scheduler preempts the elastic lease pod, which turns Degraded.
    kube.create(ENTITLEMENTS, NS, ent("gold2", "guaranteed", 8))
    bench.settle()
    assert bench.states() == {"gold": "Bound", "chat": "Degraded", "batch": "Bound",
                              "gold2": "Bound"}  # fmt: skip
    assert any(
        e["reason"] == "Degraded" and e["involvedObject"]["name"] == "chat"
        for e in kube.list(EVENTS, NS)
    )

    # One replica lost: the older guaranteed lease stays, the newer one is evicted.
    kube.patch(POOLS, None, "qwen", {"spec": {"replicas": 1}})
    bench.settle()
    assert bench.states() == {"gold": "Bound", "chat": "Degraded", "batch": "Bound",
                              "gold2": "Degraded"}  # fmt: skip
    node = kube.get(NODES, None, node_name("qwen"))
    assert node["status"]["allocatable"]["tokenpools.io/concurrency"] == "8"

    # The operator restarts: nothing is duplicated, nothing changes.
    before = sorted(p["metadata"]["name"] for e in bench.states() for p in bench.leases(e))
    bench.settle(Reconciler(kube, bench.clock, PLATFORM))
    assert sorted(p["metadata"]["name"] for e in bench.states() for p in bench.leases(e)) == before
    assert len(kube.list(NODES)) == 1

    # Deleting an entitlement removes its lease pod (finalizer), then the CR itself.
    kube.delete(ENTITLEMENTS, NS, "gold2")
    bench.settle()
    assert bench.leases("gold2") == [] and kube.find(ENTITLEMENTS, NS, "gold2") is None

    # Deleting the pool removes its node and node Lease.
    kube.delete(POOLS, None, "qwen")
    bench.rec.reconcile()
    assert kube.find(POOLS, None, "qwen") is None
    assert kube.find(NODES, None, node_name("qwen")) is None
    assert kube.find(LEASES, o.NODE_LEASE_NAMESPACE, node_name("qwen")) is None


def test_heartbeat_renews_the_node_condition_and_lease(bench: Bench) -> None:
    kube, clock = bench.kube, bench.clock
    kube.create(POOLS, None, pool())
    bench.rec.reconcile()
    name = node_name("qwen")
    first = kube.get(LEASES, o.NODE_LEASE_NAMESPACE, name)["spec"]
    assert first["holderIdentity"] == name and first["leaseDurationSeconds"] == 40
    clock.now += 10
    assert bench.rec.heartbeat() == 0
    lease = kube.get(LEASES, o.NODE_LEASE_NAMESPACE, name)["spec"]
    assert o.parse_time(lease["renewTime"]) - o.parse_time(first["renewTime"]) == pytest.approx(10)
    ready = [c for c in kube.get(NODES, None, name)["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["lastHeartbeatTime"] == o.iso(clock.now)


def _renewed(bench: Bench, name: str) -> tuple[float, float]:
    """When the node's Lease and its Ready condition were last renewed."""
    lease = bench.kube.get(LEASES, o.NODE_LEASE_NAMESPACE, name)["spec"]
    conditions = bench.kube.get(NODES, None, name)["status"]["conditions"]
    (ready,) = [c for c in conditions if c["type"] == "Ready"]
    return o.parse_time(lease["renewTime"]), o.parse_time(ready["lastHeartbeatTime"])


@pytest.mark.parametrize("failing", ["nodes", "leases"])
def test_a_heartbeat_write_that_fails_leaves_the_other_renewed(bench: Bench, failing: str) -> None:
    """Either the node's Lease or its Ready heartbeat keeps it alive for the node lifecycle
    controller: each is written on its own, so one that keeps failing does not hold back the
    other (a failing status write used to leave the Lease stale too)."""
    kube, clock = bench.kube, bench.clock
    kube.create(POOLS, None, pool())
    bench.rec.reconcile()
    name = node_name("qwen")
    before = _renewed(bench, name)
    bench.server.api.faults[:] = [Fault("patch", failing)]
    clock.now += 10
    assert bench.rec.heartbeat() == 1  # the node's heartbeat failed in part
    lease, ready = _renewed(bench, name)
    if failing == "nodes":
        assert (lease - before[0], ready) == (pytest.approx(10), before[1])
    else:
        assert (lease, ready - before[1]) == (before[0], pytest.approx(10))


def test_a_node_deleted_since_it_was_listed_gets_no_new_lease(
    bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reconciliation runs beside the heartbeat: a pool removed between the heartbeat's list
    of nodes and its writes leaves no Lease behind (nothing would ever delete it)."""
    kube = bench.kube
    kube.create(POOLS, None, pool())
    bench.rec.reconcile()
    name = node_name("qwen")
    listed = bench.rec.nodes.nodes()
    kube.delete(NODES, None, name)  # the pool's removal, meanwhile
    kube.delete(LEASES, o.NODE_LEASE_NAMESPACE, name)
    monkeypatch.setattr(bench.rec.nodes, "nodes", lambda: listed)
    assert bench.rec.heartbeat() == 0
    assert kube.find(LEASES, o.NODE_LEASE_NAMESPACE, name) is None


def _autoscaled(bench: Bench, mode: str) -> None:
    bench.kube.create(
        DEPLOYMENTS, PLATFORM, {"metadata": {"name": "vllm"}, "spec": {"replicas": 1}}
    )
    bench.kube.patch(DEPLOYMENTS, PLATFORM, "vllm", deployment_status(1, 1), sub="status")
    target = {"scaleTargetRef": {"name": "vllm"}, "minReplicas": 1,
              "autoscaling": {"cooldownS": 60, "mode": mode}}  # fmt: skip
    bench.kube.create(POOLS, None, pool(replicas=1, **target))
    bench.kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 8))
    bench.kube.create(ENTITLEMENTS, NS, ent("gold2", "guaranteed", 8))
    bench.settle()


def test_autoscaling_writes_the_scale_within_bounds_with_a_cooldown(bench: Bench) -> None:
    kube, clock = bench.kube, bench.clock
    _autoscaled(bench, "write")
    # 16 reserved slots on one ready 8-slot replica: one lease pod waits, two replicas wanted
    assert sorted(bench.states().values()) == ["Bound", "Pending"]
    assert kube.get(DEPLOYMENTS, PLATFORM, "vllm")["spec"]["replicas"] == 2
    scaled = [e for e in kube.list(EVENTS, PLATFORM) if e["reason"] == "Scaled"]
    assert len(scaled) == 1 and "from 1 to 2" in scaled[0]["message"]

    # More demand than maxReplicas allows: clamped at 4, and only after the cooldown.
    for i in range(5):
        kube.create(ENTITLEMENTS, NS, ent(f"more{i}", "guaranteed", 8))
    clock.now += 30
    bench.settle()
    assert kube.get(DEPLOYMENTS, PLATFORM, "vllm")["spec"]["replicas"] == 2
    clock.now += 31
    bench.settle()
    assert kube.get(DEPLOYMENTS, PLATFORM, "vllm")["spec"]["replicas"] == 4

    # The node follows the replicas that are ready, not the ones asked for.
    node = node_name("qwen")
    assert kube.get(NODES, None, node)["status"]["allocatable"]["tokenpools.io/concurrency"] == "8"
    kube.patch(DEPLOYMENTS, PLATFORM, "vllm", deployment_status(3, 4), sub="status")
    bench.settle()
    assert kube.get(NODES, None, node)["status"]["allocatable"]["tokenpools.io/concurrency"] == "24"
    assert list(bench.states().values()).count("Bound") == 3

    # No readyReplicas at all (the API server omits a zero): nothing is ready, the node is empty.
    kube.patch(DEPLOYMENTS, PLATFORM, "vllm", deployment_status(0, 4), sub="status")
    assert "readyReplicas" not in kube.get(DEPLOYMENTS, PLATFORM, "vllm")["status"]
    bench.settle()
    assert kube.get(NODES, None, node)["status"]["allocatable"]["tokenpools.io/concurrency"] == "0"


def test_publish_mode_leaves_the_workload_to_its_autoscaler(bench: Bench) -> None:
    from prometheus_client import generate_latest

    _autoscaled(bench, "publish")
    assert bench.kube.get(DEPLOYMENTS, PLATFORM, "vllm")["spec"]["replicas"] == 1
    status = bench.kube.get(POOLS, None, "qwen")["status"]
    assert status["desiredReplicas"] == 2 and status["replicas"] == 1
    text = generate_latest(bench.rec.metrics.registry).decode()
    assert 'tokenpools_pool_desired_replicas{pool="qwen"} 2.0' in text
    assert not [e for e in bench.kube.list(EVENTS, PLATFORM) if e["reason"] == "Scaled"]


def test_expired_and_invalid_entitlements(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, NS, ent("old", "guaranteed", 2, expiresAt="2020-01-01T00:00:00Z"))
    kube.create(ENTITLEMENTS, NS, ent("bad", "guaranteed", -3))
    kube.create(ENTITLEMENTS, NS, ent("lost", "elastic", 2, pool="nope"))
    bench.settle()
    got = {e["metadata"]["name"]: e["status"] for e in kube.list(ENTITLEMENTS, NS)}
    assert got["old"]["state"] == "Expired" and bench.leases("old") == []
    assert got["bad"]["state"] == "Invalid" and "concurrency" in got["bad"]["message"]
    assert (
        got["lost"]["state"] == "Invalid" and "no valid TokenPool 'nope'" in got["lost"]["message"]
    )
