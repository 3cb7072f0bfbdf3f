"""A lease is what the operator made: Bound means a pod the operator created, requesting exactly
the entitlement's resources and priority, bound by the scheduler to its pool's node.

A tenant with `edit` may create pods in its namespace with any name, labels, owner references
and containers. The admission policy refuses, from anyone but the operator, any pod asking for
tokenpools capacity in any container kind and any pod marked as a lease (label, annotation,
TokenEntitlement owner), on create and on update; and the operator, against the API stand-in
(which has no admission), counts only the pods it made as it makes them: a look-alike never
binds an entitlement and is deleted, whatever kind of container carries its requests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.kube.admission import refusals
from tests.kube.harness import NS, PLATFORM, Bench, bench, ent, pool
from tokenpools.control.placement import lease_requests
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, EVENTS, PODS, POOLS
from tokenpools.k8s.custom_resources import config_data
from tokenpools.k8s.lease_proof import Lease, proof
from tokenpools.model.config import parse_config
from tokenpools.model.service_class import ServiceClass

__all__ = ["bench"]

TENANT = "system:serviceaccount:tenants:ci"  # any user with `edit` in the namespace
CAPACITY = "only the tokenpools operator may create pods that hold tokenpools capacity"
MARKS = (
    "only the tokenpools operator may mark a pod as a lease pod (the tokenpools.io/lease "
    "label, the tokenpools.io/made-by annotation, a TokenEntitlement owner)"
)
OPERATOR_ONLY_LEASES = "the tokenpools operator may create lease pods only"
WANT = {"tokenpools.io/concurrency": 2, "tokenpools.io/shared-concurrency": 2}
ASK = {"requests": {"tokenpools.io/concurrency": "2"}, "limits": {"tokenpools.io/concurrency": "2"}}


def _entitlement(uid: str = "u-1") -> dict[str, Any]:
    return {"metadata": {"name": "gold", "namespace": NS, "uid": uid}, "spec": {"pool": "qwen"}}


def _lease(uid: str = "u-1") -> dict[str, Any]:
    return o.lease_pod(_entitlement(uid), ServiceClass.GUARANTEED, WANT, PLATFORM)


def _plain() -> dict[str, Any]:
    return {"metadata": {"name": "app", "namespace": NS},
            "spec": {"containers": [{"name": "app", "image": "app"}]}}  # fmt: skip


def _with(pod: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    change(out)
    return out


# -- what a pod may ask for, and how it may be marked: the admission policy -------------------

_KINDS: dict[str, Callable[[dict[str, Any]], None]] = {
    "container": lambda p: p["spec"]["containers"][0].update(resources=ASK),
    "init container": lambda p: p["spec"].update(
        initContainers=[{"name": "i", "image": "busybox", "resources": ASK}]
    ),
    "sidecar": lambda p: p["spec"].update(
        initContainers=[
            {"name": "s", "image": "envoy", "restartPolicy": "Always", "resources": ASK}
        ]
    ),
    "ephemeral container": lambda p: p["spec"].update(
        ephemeralContainers=[{"name": "e", "image": "busybox", "resources": ASK}]
    ),
    "pod-level resources": lambda p: p["spec"].update(resources=ASK),
    "PriorityClass": lambda p: p["spec"].update(priorityClassName="tokenpools-dedicated"),
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_no_container_kind_lets_a_tenant_ask_for_capacity(kind: str) -> None:
    pod = _with(_plain(), _KINDS[kind])
    assert refusals("tokenpools-lease-pods", "CREATE", "pods", pod, user=TENANT) == [CAPACITY]
    if kind == "ephemeral container":  # the one kind an update adds, through its subresource
        got = refusals("tokenpools-lease-pods", "UPDATE", "pods", pod, _plain(), TENANT,
                       sub="ephemeralcontainers")  # fmt: skip
        assert got == [CAPACITY]
    # the operator's own pods are lease pods only, with one container and nothing else
    assert OPERATOR_ONLY_LEASES in refusals("tokenpools-lease-pods", "CREATE", "pods", pod)


_MARKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "lease label": lambda p: p["metadata"].update(labels={o.LEASE_LABEL: "true"}),
    "made-by annotation": lambda p: p["metadata"].update(
        annotations={o.MADE_BY_ANNOTATION: PLATFORM}
    ),
    "entitlement owner": lambda p: p["metadata"].update(
        ownerReferences=_lease()["metadata"]["ownerReferences"]
    ),
}


@pytest.mark.parametrize("mark", sorted(_MARKS))
def test_no_one_but_the_operator_marks_a_pod_as_a_lease(mark: str) -> None:
    marked = _with(_plain(), _MARKS[mark])
    policy = "tokenpools-lease-pods"
    assert refusals(policy, "CREATE", "pods", marked, user=TENANT) == [MARKS]
    # nor on an update of a pod that exists (labels, annotations and owners are mutable)
    assert refusals(policy, "UPDATE", "pods", marked, _plain(), TENANT) == [MARKS]
    # an update that leaves the marks as they were is no business of the policy's
    relabelled = _with(marked, lambda p: p["metadata"].setdefault("labels", {}).update(x="y"))
    assert refusals(policy, "UPDATE", "pods", relabelled, marked, TENANT) == []


def test_what_the_operator_may_create_and_what_others_may_change() -> None:
    policy, lease = "tokenpools-lease-pods", _lease()
    assert refusals(policy, "CREATE", "pods", lease) == []
    # the operator leaves binding to the scheduler, and makes nothing but a lease pod
    for change in (
        lambda p: p["spec"].update(nodeName="tokenpools-qwen"),
        lambda p: p["spec"].update(initContainers=[{"name": "i", "image": "x"}]),
        lambda p: p["spec"]["containers"][0].update(image="busybox"),
        lambda p: p["metadata"]["labels"].pop(o.LEASE_LABEL),
    ):
        assert OPERATOR_ONLY_LEASES in refusals(policy, "CREATE", "pods", _with(lease, change))
    # the garbage collector orphans a lease pod (drops the owner): allowed to anyone
    orphaned = _with(lease, lambda p: p["metadata"].pop("ownerReferences"))
    assert refusals(policy, "UPDATE", "pods", orphaned, lease, "system:gc") == []
    # a tenant can neither move a lease to another entitlement nor re-sign it
    for change in (
        lambda p: p["metadata"]["ownerReferences"][0].update(uid="u-2"),
        lambda p: p["metadata"]["annotations"].update({o.MADE_BY_ANNOTATION: "x"}),
    ):
        assert refusals(policy, "UPDATE", "pods", _with(lease, change), lease, TENANT) == [MARKS]


# -- the operator's own proof -----------------------------------------------------------------


def test_only_a_pod_made_as_the_operator_makes_it_is_a_lease() -> None:
    lease = _lease()
    assert proof(lease, "u-1", "gold", PLATFORM) == Lease(ServiceClass.GUARANTEED, WANT)
    admitted = _with(lease, lambda p: p["spec"].update(priority=900_000))  # set by admission
    assert isinstance(proof(admitted, "u-1", "gold", PLATFORM), Lease)
    changes: dict[str, Callable[[dict[str, Any]], None]] = {
        "no lease label": lambda p: p["metadata"]["labels"].pop(o.LEASE_LABEL),
        "not owned by the entitlement": lambda p: p["metadata"].pop("ownerReferences"),
        "another installation made it": lambda p: p["metadata"]["annotations"].update(
            {o.MADE_BY_ANNOTATION: "tokenpools-blue"}
        ),
        "its PriorityClass is not a service class's": lambda p: p["spec"].pop("priorityClassName"),
        "its priority 1 is not its class's": lambda p: p["spec"].update(priority=1),
        "init, sidecar or ephemeral": lambda p: p["spec"].update(
            ephemeralContainers=[{"name": "e", "image": "busybox"}]
        ),
        "not one pause container": lambda p: p["spec"]["containers"].append(
            {"name": "two", "image": o.PAUSE_IMAGE}
        ),
        "requests are not": lambda p: p["spec"]["containers"][0].update(
            resources={"requests": {"tokenpools.io/concurrency": "2"}}  # no limits
        ),
        "name does not match": lambda p: p["spec"]["containers"][0]["resources"].update(
            requests={**ASK["requests"]}, limits={**ASK["limits"]}
        ),
    }
    for why, change in changes.items():
        got = proof(_with(lease, change), "u-1", "gold", PLATFORM)
        assert isinstance(got, str) and why in got, (why, got)
    assert isinstance(proof(lease, "u-2", "gold", PLATFORM), str)  # someone else's lease


def _gold_requests(bench: Bench) -> dict[str, int]:
    """What the operator's lease pod for gold requests (so the look-alike takes its name)."""
    cluster = config_data(bench.kube.list(POOLS), bench.kube.list(ENTITLEMENTS))
    return lease_requests(parse_config(cluster.data).entitlements[f"{NS}/gold"])


def _impostor(bench: Bench, uid: str, change: Callable[[dict[str, Any]], None]) -> Any:
    """The operator's lease pod as a tenant would copy it (name, label, annotation, owner,
    PriorityClass, tolerations: the stand-in has no admission to refuse any of it), changed."""
    want = _gold_requests(bench)
    pod = o.lease_pod(_entitlement(uid), ServiceClass.GUARANTEED, want, PLATFORM)
    for c in pod["spec"]["containers"]:
        c["resources"] = {}
    change(pod)
    return bench.kube.create(PODS, NS, pod)


_LOOK_ALIKES: dict[str, Callable[[dict[str, Any]], None]] = {
    "no requests": lambda p: None,
    "requests in an init container": _KINDS["init container"],
    "requests in a sidecar": _KINDS["sidecar"],
    "requests in an ephemeral container": _KINDS["ephemeral container"],
    "a second container": lambda p: p["spec"]["containers"].append(
        {"name": "work", "image": "busybox", "resources": ASK}
    ),
}


@pytest.mark.parametrize("variant", sorted(_LOOK_ALIKES))
def test_a_tenants_look_alike_pod_never_makes_an_entitlement_bound(
    bench: Bench, variant: str
) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    bench.settle()
    gold = kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    fake = _impostor(bench, gold["metadata"]["uid"], _LOOK_ALIKES[variant])
    bench.sched.run()  # it tolerates the node and selects it: kube-scheduler binds it
    assert kube.get(PODS, NS, fake["metadata"]["name"])["spec"]["nodeName"] == "tokenpools-qwen"

    bench.rec.reconcile()
    assert bench.states() == {"gold": "Pending"}  # not Bound on a pod the operator did not make
    assert kube.find(PODS, NS, fake["metadata"]["name"]) is None or (
        kube.get(PODS, NS, fake["metadata"]["name"])["metadata"]["uid"] != fake["metadata"]["uid"]
    )
    [warning] = [e for e in kube.list(EVENTS, NS) if e["reason"] == "NotALeasePod"]
    assert "not a lease pod the operator made" in warning["message"]

    bench.settle()  # the operator's own lease pod, under the same name, binds
    assert bench.states() == {"gold": "Bound"}
    [lease] = bench.leases("gold")
    assert lease["metadata"]["uid"] != fake["metadata"]["uid"]
    assert lease["metadata"]["annotations"][o.MADE_BY_ANNOTATION] == PLATFORM
    status = kube.get(ENTITLEMENTS, NS, "gold")["status"]
    assert lease["metadata"]["name"] == fake["metadata"]["name"]  # the name it had taken
    assert status["podName"] == lease["metadata"]["name"]
    assert status["requests"] == _gold_requests(bench)


def test_a_lease_pod_of_an_earlier_version_stays_bound(bench: Bench) -> None:
    """Made before the made-by annotation and the cpu/memory requests: the same name (the
    digest covers the class and the tokenpools requests only), so it is neither replaced nor
    deleted, and the entitlement stays Bound on it."""
    kube = bench.kube
    kube.create(POOLS, None, pool())
    bench.settle()
    gold = kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    old = o.lease_pod(gold, ServiceClass.GUARANTEED, _gold_requests(bench), PLATFORM)
    old["metadata"].pop("annotations")
    for key in ("requests", "limits"):
        for small in ("cpu", "memory"):
            old["spec"]["containers"][0]["resources"][key].pop(small)
    old = kube.create(PODS, NS, old)
    bench.settle()
    assert bench.states() == {"gold": "Bound"}
    assert [p["metadata"]["uid"] for p in bench.leases("gold")] == [old["metadata"]["uid"]]
    assert [e for e in kube.list(EVENTS, NS) if e["reason"] == "NotALeasePod"] == []


def test_a_lease_pod_read_back_in_canonical_form_stays_bound(bench: Bench) -> None:
    """The API server stores quantities in canonical form: a 40000-token KV baseline reads back
    as "40k". The operator compares numbers, so its own lease pod stays Bound, undeleted."""
    kube = bench.kube
    per = {"tokensPerSecond": 240, "kvTokens": 160_000, "concurrency": 8}
    kube.create(POOLS, None, pool(perReplica=per))
    bench.settle()
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    bench.settle()
    assert bench.states() == {"gold": "Bound"}
    [lease] = bench.leases("gold")
    stored = lease["spec"]["containers"][0]["resources"]
    kv = [v for k, v in stored["requests"].items() if "kv" in k]
    assert kv and set(kv) == {"40k"}, stored  # as the server writes it back
    _kept_for_ninety_seconds(bench, lease)
    status = kube.get(ENTITLEMENTS, NS, "gold")["status"]
    assert [v for k, v in status["requests"].items() if "kv" in k] == [40_000] * len(kv)


def test_proof_compares_quantities_as_numbers() -> None:
    canonical = {"tokenpools.io/concurrency": "2", "tokenpools.io/shared-concurrency": "2e0",
                 "cpu": "0.001", "memory": "4096Ki"}  # fmt: skip
    pod = _with(
        _lease(),
        lambda p: p["spec"]["containers"][0].update(
            resources={"requests": canonical, "limits": {**canonical, "cpu": "1m"}}
        ),
    )
    assert proof(pod, "u-1", "gold", PLATFORM) == Lease(ServiceClass.GUARANTEED, WANT)
    fraction = _with(
        pod,
        lambda p: [
            p["spec"]["containers"][0]["resources"][k].update({"tokenpools.io/concurrency": "1.5"})
            for k in ("requests", "limits")
        ],
    )
    assert isinstance(proof(fraction, "u-1", "gold", PLATFORM), str)


def _inject_storage(pod: dict[str, Any]) -> None:
    """What a LimitRange default or a mutating webhook (Kyverno) does to a pod: an
    ephemeral-storage request and limit, and the memory limit raised."""
    resources = pod["spec"]["containers"][0]["resources"]
    resources["requests"].update({"ephemeral-storage": "1Gi"})
    resources["limits"].update({"ephemeral-storage": "2Gi", "memory": "8Mi"})


def test_resources_admission_adds_leave_a_lease_pod_bound(bench: Bench) -> None:
    """A pod the operator made, with resources added by admission, is still its lease pod: the
    proof looks only at the tokenpools.io/* requests, which admission leaves to the operator."""
    lease = _with(_lease(), _inject_storage)
    assert proof(lease, "u-1", "gold", PLATFORM) == Lease(ServiceClass.GUARANTEED, WANT)
    pod_level = _with(lease, lambda p: p["spec"].update(resources=ASK))
    got = proof(pod_level, "u-1", "gold", PLATFORM)
    assert isinstance(got, str) and "pod level" in got

    kube = bench.kube
    kube.create(POOLS, None, pool())
    bench.settle()
    gold = kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    made = _with(
        o.lease_pod(gold, ServiceClass.GUARANTEED, _gold_requests(bench), PLATFORM),
        _inject_storage,
    )
    made = kube.create(PODS, NS, made)  # as the operator would create it, admission applied
    _kept_for_ninety_seconds(bench, made)


def _kept_for_ninety_seconds(bench: Bench, lease: dict[str, Any]) -> None:
    """Three operator passes 30 s apart: gold stays Bound on `lease`, the same pod, never
    taken for a look-alike."""
    for _ in range(3):
        bench.clock.now += 30
        bench.settle()
    assert bench.states() == {"gold": "Bound"}
    assert [p["metadata"]["uid"] for p in bench.leases("gold")] == [lease["metadata"]["uid"]]
    assert [e for e in bench.kube.list(EVENTS, NS) if e["reason"] == "NotALeasePod"] == []
