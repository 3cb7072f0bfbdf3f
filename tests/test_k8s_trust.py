"""What a platform team checks before an operator goes near a shared cluster: a refused write
fails one object, not the cluster; an edit never takes a binding away; capacity does not
flap; dedicated never preempts guaranteed; foreign pods get nothing from a virtual node; and
with a share of writes failing for many simulated minutes, nothing bound is lost."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kube.api_faults import Fault
from tests.kube.harness import (
    DEPLOYMENTS,
    NS,
    PLATFORM,
    TENANT_LABEL,
    Bench,
    bench,
    deployment_status,
    ent,
    pool,
)
from tests.kube.soak import soak
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, EVENTS, NODES, PODS, POOLS
from tokenpools.k8s.names import node_name

__all__ = ["bench"]


def _alloc(bench: Bench, pool_name: str = "qwen") -> int:
    node = bench.kube.get(NODES, None, node_name(pool_name))
    return int(node["status"]["allocatable"]["tokenpools.io/concurrency"])


def test_a_refused_lease_pod_fails_only_its_entitlement(bench: Bench) -> None:
    kube = bench.kube
    bench.namespace("strict", TENANT_LABEL)
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, "strict", ent("blocked", "guaranteed", 2))
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    bench.server.api.faults.append(Fault("create", "pods", "strict", status=403))
    bench.settle()
    assert bench.states() == {"gold": "Bound"}
    blocked = kube.get(ENTITLEMENTS, "strict", "blocked")
    cond = {c["type"]: c for c in blocked["status"]["conditions"]}["Reconciled"]
    assert cond["status"] == "False" and "403 Forbidden" in cond["message"]
    assert any(e["reason"] == "ReconcileError" for e in kube.list(EVENTS, "strict"))
    bench.server.api.faults.clear()
    bench.clock.now += 600  # past the backoff
    bench.settle()
    assert bench.states("strict") == {"blocked": "Bound"}
    blocked = kube.get(ENTITLEMENTS, "strict", "blocked")
    conds = {c["type"]: c["status"] for c in blocked["status"]["conditions"]}
    assert conds["Reconciled"] == "True" and conds["Bound"] == "True"


def test_an_invalid_edit_keeps_the_applied_spec_and_the_lease(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 4))
    bench.settle()
    [lease] = bench.leases("gold")
    kube.patch(ENTITLEMENTS, NS, "gold", {"spec": {"concurrency": -1}})
    kube.patch(POOLS, None, "qwen", {"spec": {"model": "qwen3-8b"}})  # wrong case
    bench.settle()
    gold = kube.get(ENTITLEMENTS, NS, "gold")
    assert gold["status"]["state"] == "Bound" and gold["status"]["appliedSpec"]["concurrency"] == 4
    accepted = {c["type"]: c for c in gold["status"]["conditions"]}["SpecAccepted"]
    assert accepted["status"] == "False" and "concurrency" in accepted["message"]
    assert [p["metadata"]["uid"] for p in bench.leases("gold")] == [lease["metadata"]["uid"]]
    qwen = kube.get(POOLS, None, "qwen")
    assert qwen["status"]["appliedSpec"]["model"] == "Qwen3-8B" and _alloc(bench) == 16
    assert any(e["reason"] == "InvalidSpec" for e in kube.list(EVENTS, NS))


def test_a_resize_keeps_the_binding_until_the_new_lease_binds(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 6))
    kube.create(ENTITLEMENTS, NS, ent("other", "guaranteed", 6))
    bench.settle()
    kube.patch(ENTITLEMENTS, NS, "gold", {"spec": {"concurrency": 8}})  # 6 + 6 + 8 > 16
    bench.settle()
    gold = kube.get(ENTITLEMENTS, NS, "gold")["status"]
    assert gold["state"] == "Bound" and gold["appliedSpec"]["concurrency"] == 6
    assert "resize waiting" in gold["message"] and len(bench.leases("gold")) == 2
    kube.delete(ENTITLEMENTS, NS, "other")
    bench.settle()
    gold = kube.get(ENTITLEMENTS, NS, "gold")["status"]
    assert gold["state"] == "Bound" and gold["appliedSpec"]["concurrency"] == 8
    [lease] = bench.leases("gold")
    assert (
        lease["spec"]["containers"][0]["resources"]["requests"]["tokenpools.io/concurrency"] == "8"
    )


def test_capacity_shrinks_only_after_a_sustained_dip(bench: Bench) -> None:
    kube, clock = bench.kube, bench.clock
    kube.create(DEPLOYMENTS, PLATFORM, {"metadata": {"name": "vllm"}, "spec": {"replicas": 2}})
    kube.patch(DEPLOYMENTS, PLATFORM, "vllm", deployment_status(2, 2), sub="status")
    kube.create(POOLS, None, pool(scaleTargetRef={"name": "vllm"}, capacityShrinkAfterS=60))
    kube.create(ENTITLEMENTS, NS, ent("a", "guaranteed", 8))
    kube.create(ENTITLEMENTS, NS, ent("b", "guaranteed", 8))
    bench.settle()
    assert _alloc(bench) == 16 and bench.states() == {"a": "Bound", "b": "Bound"}
    kube.patch(DEPLOYMENTS, PLATFORM, "vllm", deployment_status(1, 2), sub="status")  # rolling
    for _ in range(5):
        clock.now += 10
        bench.settle()
    assert _alloc(bench) == 16 and bench.states() == {"a": "Bound", "b": "Bound"}
    kube.patch(DEPLOYMENTS, PLATFORM, "vllm", deployment_status(2, 2), sub="status")
    clock.now += 10
    bench.settle()
    assert kube.get(POOLS, None, "qwen")["status"].get("shrinkPendingSince") is None
    kube.patch(DEPLOYMENTS, PLATFORM, "vllm", deployment_status(1, 2), sub="status")
    for _ in range(7):
        clock.now += 10
        bench.settle()
    assert _alloc(bench) == 8 and sorted(bench.states().values()) == ["Bound", "Degraded"]


def test_dedicated_never_preempts_guaranteed(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 12))
    bench.settle()
    kube.create(ENTITLEMENTS, NS, ent("vip", "dedicated", 8))
    bench.settle()
    assert bench.states() == {"gold": "Bound", "vip": "Pending"}
    kube.delete(ENTITLEMENTS, NS, "gold")
    bench.settle()
    assert bench.states() == {"vip": "Bound"}


def test_a_foreign_pod_on_a_virtual_node_is_failed(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    bench.settle()
    sneaky = {
        "metadata": {"name": "sneaky", "labels": {o.LEASE_LABEL: "true"}},
        "spec": {"nodeSelector": {o.POOL_LABEL: "qwen"},
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "x", "image": "busybox"}]},
    }  # fmt: skip
    kube.create(PODS, NS, sneaky)
    bench.settle()
    pod = kube.get(PODS, NS, "sneaky")
    assert pod["spec"]["nodeName"] == node_name("qwen")
    assert pod["status"]["phase"] == "Failed" and pod["status"]["reason"] == "NotALeasePod"


def test_namespaces_the_pool_is_not_open_to_and_shared_keys_are_refused(bench: Bench) -> None:
    kube = bench.kube
    bench.namespace("outsider")
    kube.create(POOLS, None, pool())
    key = {"apiKeyHashes": ["sha256:" + "a" * 64]}
    kube.create(ENTITLEMENTS, NS, ent("first", "elastic", 2, **key))
    kube.create(ENTITLEMENTS, "outsider", ent("sneak", "guaranteed", 2))
    bench.settle()
    bench.namespace("copycat", TENANT_LABEL)
    kube.create(ENTITLEMENTS, "copycat", ent("second", "elastic", 2, **key))
    bench.settle()
    assert bench.states() == {"first": "Bound"}
    sneak = kube.get(ENTITLEMENTS, "outsider", "sneak")["status"]
    assert sneak["state"] == "Invalid" and "not open to namespace 'outsider'" in sneak["message"]
    second = kube.get(ENTITLEMENTS, "copycat", "second")["status"]
    assert second["state"] == "Invalid" and "already used" in second["message"]


def test_long_names_make_valid_distinct_nodes_and_labels(bench: Bench) -> None:
    kube = bench.kube
    long_a, long_b = "p" * 250 + "a", "p" * 250 + "b"
    for name in (long_a, long_b):
        kube.create(POOLS, None, pool(name, servedModels=[name]))
    kube.create(ENTITLEMENTS, NS, ent("e" * 240, "guaranteed", 2, pool=long_a))
    bench.settle()
    nodes = [n["metadata"] for n in kube.list(NODES)]
    assert len({n["name"] for n in nodes}) == 2 and all(len(n["name"]) <= 253 for n in nodes)
    assert all(len(v) <= 63 for n in nodes for v in n["labels"].values())
    assert bench.states() == {"e" * 240: "Bound"}


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**16), rate=st.sampled_from([0.05, 0.1, 0.2]))
def test_ten_minutes_of_failing_writes_lose_nothing_bound(
    bench: Bench, seed: int, rate: float
) -> None:
    """The operator as deployed (its loop: heartbeat every 10 s, reconciliation on a wake
    and every 30 s) over 12 simulated minutes, with `rate` of all writes failing and one
    namespace refusing every lease pod: every node's heartbeat stays fresh, no lease pod is
    replaced, every Bound entitlement stays Bound; after one change the loop settles."""
    _reset(bench)
    got = soak(bench, seed, rate)
    assert len(got.bound_before) == 4 and got.failed > 0
    assert got.worst_lease_age_s < 40  # the node Lease's duration: never stale
    assert got.lost == [] and got.pods_replaced == 0
    assert got.passes_to_settle < 4 and got.applied_after_edit == 900


def _reset(bench: Bench) -> None:
    """Hypothesis reuses the fixture: start each example from an empty cluster."""
    api = bench.server.api
    api.faults.clear()
    for key in [k for k in api.store if k[1] in ("tokenpools", "tokenentitlements", "pods",
                                                  "nodes", "leases", "events")]:  # fmt: skip
        api.store[key].clear()
    api.store[("v1", "namespaces")].pop((None, "strict"), None)
    bench.rec.__init__(bench.kube, bench.clock, PLATFORM)  # type: ignore[misc]
