"""Only its own nodes, only its own Secrets (issue 37).

Against the API stand-in: a Node that already has the name a pool's virtual node would take —
someone's real node, or another installation's virtual node — is never adopted (not labelled,
not patched, no heartbeat, its pods neither failed nor finalized, not deleted with the pool),
nothing binds onto it, and the pool says why. A Secret of the platform's namespace that is not
labelled as a backend key is never listed, watched or read by the gateway, whatever a
TokenPool's apiKeySecretRef names, and the pool says why; a labelled one works. And the
ValidatingAdmissionPolicy that narrows the operator's node and pod rights, evaluated with a CEL
library as the API server would."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.admission import OPERATOR, refusals
from tests.kube.admission import policy as admission_policy
from tests.kube.harness import NS, PLATFORM, Bench, bench, ent, pool
from tests.servers import wait_until
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, EVENTS, LEASES, NODES, PODS, POOLS, SECRETS
from tokenpools.k8s.names import node_name
from tokenpools.k8s.reconciler import Reconciler
from tokenpools.k8s.source import BackendKeyRefused, ClusterSource
from tokenpools.model.service_class import ServiceClass

__all__ = ["bench"]

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "base"
NODE = node_name("qwen")


def _pod_on(name: str, node: str, **meta: Any) -> dict[str, Any]:
    containers = [{"name": "app", "image": "app"}]
    return {
        "metadata": {"name": name, **meta},
        "spec": {"nodeName": node, "containers": containers},
    }


def _node_writes(bench: Bench, since: int) -> list[tuple[str, str, str | None, int]]:
    return [w for w in bench.server.api.writes[since:] if w[1] == "nodes"]


def _pool_ready(bench: Bench) -> dict[str, Any]:
    qwen = bench.kube.get(POOLS, None, "qwen")
    ready: dict[str, Any] = {c["type"]: c for c in qwen["status"]["conditions"]}["Ready"]
    return ready


def test_a_node_of_the_same_name_is_never_adopted_nor_deleted(bench: Bench) -> None:
    kube = bench.kube
    labels = {"kubernetes.io/hostname": "gpu-7", "team": "infra"}
    kube.create(NODES, None, {"metadata": {"name": NODE, "labels": labels}, "spec": {}})
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}
    status = {"allocatable": {"cpu": "64", "pods": "110"}, "conditions": [ready]}
    kube.patch(NODES, None, NODE, {"status": status}, sub="status")
    kube.create(PODS, NS, _pod_on("app", NODE))
    kube.create(PODS, NS, _pod_on("leaving", NODE))
    kube.delete(PODS, NS, "leaving")  # graceful: terminating, for its own kubelet to end
    before = {"node": kube.get(NODES, None, NODE), "pods": kube.list(PODS, NS)}
    since = len(bench.server.api.writes)

    kube.create(POOLS, None, pool())
    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    for _ in range(3):
        bench.settle()
        bench.clock.now += 10
        assert bench.rec.heartbeat() == 0

    # nothing written to the node or its pods, no node Lease taken over or made
    assert _node_writes(bench, since) == []
    assert kube.get(NODES, None, NODE) == before["node"]  # labels, allocatable, version
    assert kube.list(PODS, NS, fields={"spec.nodeName": NODE}) == before["pods"]
    assert kube.find(LEASES, o.NODE_LEASE_NAMESPACE, NODE) is None
    # the pool says why, once; the entitlement waits, bound to nothing
    ready = _pool_ready(bench)
    assert ready["status"] == "False" and ready["reason"] == "NodeConflict"
    assert NODE in ready["message"] and o.INSTALLATION_LABEL in ready["message"]
    assert "nodeName" not in kube.get(POOLS, None, "qwen")["status"]
    conflicts = [e for e in kube.list(EVENTS, PLATFORM) if e["reason"] == "NodeConflict"]
    assert len(conflicts) == 1 and conflicts[0]["involvedObject"]["name"] == "qwen"
    assert bench.states() == {"gold": "Pending"}
    assert all(p["spec"].get("nodeName") is None for p in bench.leases("gold"))

    # the pool goes: its finalizer is dropped, the node it never owned stays
    kube.delete(POOLS, None, "qwen")
    bench.rec.reconcile()
    assert kube.find(POOLS, None, "qwen") is None
    assert kube.get(NODES, None, NODE) == before["node"]
    assert [p["metadata"]["name"] for p in kube.list(PODS, NS)] == ["app", "leaving"]
    assert _node_writes(bench, since) == []


def test_another_installations_node_is_left_to_it_and_nothing_binds_onto_it(
    bench: Bench,
) -> None:
    kube = bench.kube
    blue = Reconciler(kube, bench.clock, "tokenpools-blue")  # its installation: its namespace
    kube.create(POOLS, None, pool())
    blue.reconcile()  # blue's virtual node for the pool: Ready, the pool's label and taint
    theirs = kube.get(NODES, None, NODE)
    assert theirs["metadata"]["labels"][o.INSTALLATION_LABEL] == "tokenpools-blue"
    assert theirs["metadata"]["labels"][o.POOL_LABEL] == "qwen"
    assert int(theirs["status"]["allocatable"]["tokenpools.io/concurrency"]) == 16
    kube.create(PODS, NS, _pod_on("blues", NODE))  # blue's kubelet's business, not ours
    since = len(bench.server.api.writes)

    kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 2))
    bench.settle()
    bench.clock.now += 10
    assert bench.rec.heartbeat() == 0
    assert _node_writes(bench, since) == []
    assert kube.get(NODES, None, NODE) == theirs
    assert (kube.get(PODS, NS, "blues").get("status") or {}).get("phase") != "Failed"
    # gold's lease pod tolerates the taint and selects pool qwen: on blue's node it would fit,
    # but it selects this installation's node, so kube-scheduler leaves it Pending
    [lease] = bench.leases("gold")
    assert lease["spec"]["nodeSelector"][o.INSTALLATION_LABEL] == PLATFORM
    assert lease["spec"].get("nodeName") is None and bench.states() == {"gold": "Pending"}
    assert _pool_ready(bench)["reason"] == "NodeConflict"

    # blue is uninstalled, its node with it: this installation makes its own, and gold binds
    kube.delete(NODES, None, NODE)
    bench.settle()
    mine = kube.get(NODES, None, NODE)
    assert mine["metadata"]["labels"][o.INSTALLATION_LABEL] == PLATFORM
    assert bench.states() == {"gold": "Bound"}
    assert _pool_ready(bench)["status"] == "True"


def test_only_the_installations_own_nodes_are_heartbeaten_and_cleaned_up(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool())
    bench.settle()
    # a node of another installation for a pool this one no longer has, found as an orphan
    blue = o.node("gone", "tokenpools-blue")
    kube.create(NODES, None, blue)
    blue = kube.get(NODES, None, node_name("gone"))
    bench.clock.now += 10
    assert bench.rec.heartbeat() == 0
    bench.rec.reconcile()
    assert kube.get(NODES, None, node_name("gone")) == blue  # no heartbeat, not deleted
    assert kube.find(LEASES, o.NODE_LEASE_NAMESPACE, node_name("gone")) is None
    assert [n["metadata"]["name"] for n in bench.rec.nodes.nodes()] == [NODE]


# -- backend keys: labelled Secrets only ------------------------------------------------------


def _secret(name: str, data: dict[str, bytes], labelled: bool) -> dict[str, Any]:
    labels = {o.BACKEND_KEY_LABEL: "true"} if labelled else {}
    encoded = {k: base64.b64encode(v).decode() for k, v in data.items()}
    return {"metadata": {"name": name, "labels": labels}, "data": encoded}


def _source(bench: Bench) -> ClusterSource:
    return ClusterSource(bench.kube, PLATFORM, {}, background=lambda step: step()).start()


def _secret_requests(bench: Bench) -> list[Any]:
    return [r for r in list(bench.server.api) if "/secrets" in r.url.path]


def test_a_secret_not_labelled_as_a_backend_key_is_never_read(bench: Bench) -> None:
    kube = bench.kube
    tls = {"tls.key": b"-----BEGIN PRIVATE KEY----- webhook", "tls.crt": b"cert"}
    kube.create(SECRETS, PLATFORM, _secret("tokenpools-webhook-tls", tls, labelled=False))
    key = {"apiKey": b"backend-secret\n"}
    kube.create(SECRETS, PLATFORM, _secret("vllm-key", key, labelled=True))
    # a pool writer names the webhook's TLS key as the backend key of a URL of its choosing
    ref = {"name": "tokenpools-webhook-tls", "key": "tls.key"}
    kube.create(
        POOLS, None, pool(backends=[{"url": "http://evil.example", "apiKeySecretRef": ref}])
    )
    bench.settle()
    assert kube.get(POOLS, None, "qwen")["status"]["appliedSpec"]["backends"][0]["url"]

    setup = len(_secret_requests(bench))  # the two Secrets created above
    source = _source(bench)
    try:
        with pytest.raises(BackendKeyRefused) as refused:
            source.config()
        with pytest.raises(BackendKeyRefused):
            source.config()  # asked again (every change): reported once
        held = [s["metadata"]["name"] for s in source._informers[2].items()]
        # the informer's watch follows its list from a thread of its own: seen before it stops
        wait_until(lambda: any(r.params.get("watch") for r in _secret_requests(bench)[setup:]))
    finally:
        source.stop()
    why = str(refused.value)
    assert "'tokenpools-webhook-tls' is not a backend key" in why and o.BACKEND_KEY_LABEL in why
    assert "PRIVATE" not in why and held == ["vllm-key"]
    # what the stand-in served: Secrets only ever listed and watched by the label, none by name
    asked = _secret_requests(bench)[setup:]
    assert {r.params.get("watch") for r in asked} == {None, "true"}  # a list, then a watch
    assert all(r.url.path == f"/api/v1/namespaces/{PLATFORM}/secrets" for r in asked)
    assert all(r.params.get("labelSelector") == "tokenpools.io/backend-key=true" for r in asked)
    # the pool says why: a Warning Event on it, from the gateway
    [event] = [e for e in kube.list(EVENTS, PLATFORM) if e["reason"] == "BackendKeyRefused"]
    assert event["involvedObject"]["kind"] == "TokenPool"
    assert event["involvedObject"]["name"] == "qwen" and event["type"] == "Warning"
    assert "tokenpools-webhook-tls" in event["message"]

    # the platform's labelled Secret: the key is used
    ref = {"name": "vllm-key", "key": "apiKey"}
    backends = [{"url": "http://vllm:8000", "apiKeySecretRef": ref}]
    kube.patch(POOLS, None, "qwen", {"spec": {"backends": backends}})
    bench.settle()
    source = _source(bench)
    try:
        [backend] = source.config().pools["qwen"].backends
    finally:
        source.stop()
    assert (backend.url, backend.api_key) == ("http://vllm:8000", "backend-secret")


def _labelled(value: str | None) -> dict[str, Any]:
    return {"metadata": {"labels": {o.BACKEND_KEY_LABEL: value}}}


def test_a_key_whose_label_is_taken_away_is_dropped_by_the_watch(bench: Bench) -> None:
    kube = bench.kube
    kube.create(SECRETS, PLATFORM, _secret("vllm-key", {"apiKey": b"k1"}, labelled=True))
    ref = {"name": "vllm-key", "key": "apiKey"}
    kube.create(POOLS, None, pool(backends=[{"url": "http://vllm:8000", "apiKeySecretRef": ref}]))
    bench.settle()
    source = _source(bench)
    try:
        assert source.config().pools["qwen"].backends[0].api_key == "k1"
        kube.patch(SECRETS, PLATFORM, "vllm-key", _labelled(None))  # the label taken away
        wait_until(lambda: source._informers[2].items() == [])
        with pytest.raises(BackendKeyRefused, match="'vllm-key' is not a backend key"):
            source.config()
        kube.patch(SECRETS, PLATFORM, "vllm-key", _labelled("true"))
        wait_until(lambda: len(source._informers[2].items()) == 1)
        assert source.config().pools["qwen"].backends[0].api_key == "k1"
    finally:
        source.stop()
    events = [e for e in kube.list(EVENTS, PLATFORM) if e["reason"] == "BackendKeyRefused"]
    assert len(events) == 1


# -- the admission policy: the operator's node and pod writes -------------------------------


def _refusals(
    operation: str,
    resource: str,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
    user: str = OPERATOR,
    sub: str = "",
) -> list[str]:
    return refusals("tokenpools-operator-scope", operation, resource, new, old, user, sub)


NODES_ONLY = "the tokenpools operator may write only the Nodes of its own installation"
PODS_ONLY = (
    "the tokenpools operator may delete only lease pods and terminating pods on its virtual nodes"
)


def test_the_admission_policy_keeps_the_operator_to_its_installations_nodes() -> None:
    mine, blue = o.node("qwen", PLATFORM), o.node("qwen", "tokenpools-blue")
    worker = {"metadata": {"name": "worker-1", "labels": {"team": "infra"}}}
    assert _refusals("CREATE", "nodes", mine, None) == []
    assert _refusals("CREATE", "nodes", blue, None) == [NODES_ONLY]
    assert _refusals("UPDATE", "nodes", mine, mine, sub="status") == []
    for other in (blue, worker):
        assert _refusals("UPDATE", "nodes", other, other, sub="status") == [NODES_ONLY]
        assert _refusals("DELETE", "nodes", None, other) == [NODES_ONLY]
        labels = mine["metadata"]["labels"]
        relabelled = {**other, "metadata": {**other["metadata"], "labels": labels}}
        assert _refusals("UPDATE", "nodes", relabelled, other) == [NODES_ONLY]  # no taking
    assert _refusals("DELETE", "nodes", None, mine) == []
    stripped = {**mine, "metadata": {"name": mine["metadata"]["name"], "labels": {}}}
    assert _refusals("UPDATE", "nodes", stripped, mine) == [NODES_ONLY]
    # the policy binds the operator only: a cluster admin deletes any node
    assert _refusals("DELETE", "nodes", None, worker, user="kubernetes-admin") == []


def test_the_admission_policy_lets_the_operator_delete_only_its_pods() -> None:
    ent_ = {"metadata": {"name": "e", "namespace": "t", "uid": "u"}, "spec": {"pool": "p"}}
    lease = o.lease_pod(ent_, ServiceClass.GUARANTEED, {"tokenpools.io/concurrency": 2})
    assert _refusals("DELETE", "pods", None, lease) == []
    on_ours = _pod_on("sneaky", NODE)
    elsewhere = _pod_on("app", "worker-1")
    gone = {"deletionTimestamp": "2026-01-01T00:00:00Z"}
    terminating = {**on_ours, "metadata": {**on_ours["metadata"], **gone}}
    assert _refusals("DELETE", "pods", None, terminating) == []  # the kubelet's finalization
    assert _refusals("DELETE", "pods", None, on_ours) == [PODS_ONLY]  # not terminating
    assert _refusals("DELETE", "pods", None, elsewhere) == [PODS_ONLY]
    leaving = {**elsewhere, "metadata": {**elsewhere["metadata"], **gone}}
    assert _refusals("DELETE", "pods", None, leaving) == [PODS_ONLY]  # not on a virtual node
    failed = {**on_ours, "status": {"phase": "Failed"}}
    assert _refusals("UPDATE", "pods", failed, on_ours, sub="status") == []  # NotALeasePod
    assert _refusals("UPDATE", "pods", elsewhere, elsewhere, sub="status") == [PODS_ONLY]
    assert _refusals("DELETE", "pods", None, elsewhere, user="kubernetes-admin") == []


def test_the_installation_id_agrees_across_operator_policy_and_code() -> None:
    """The policy's installation and user, the operator's setting, and the default id."""
    policy = admission_policy("tokenpools-operator-scope")
    value = {v["name"]: v["expression"] for v in policy["variables"]}["installation"]
    docs = list(yaml.safe_load_all((DEPLOY / "operator.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert value == f'"{env["TOKENPOOLS_INSTALLATION"]}"' == f'"{o.DEFAULT_INSTALLATION}"'
    assert o.installation_id(None, "tokenpools-system") == o.DEFAULT_INSTALLATION
    assert o.installation_id("blue", "tokenpools-system") == "blue"
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    ns = deployment["metadata"]["namespace"]
    assert f"system:serviceaccount:{ns}:{sa}" == OPERATOR
    assert OPERATOR in policy["matchConditions"][0]["expression"]
