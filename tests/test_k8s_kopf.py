"""The operator as it is deployed: kopf watching the API server stand-in over HTTP, and
leader election between two replicas."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client

from tests.kube.apiserver import ServerThread
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, LEASES, NAMESPACES, NODES, PODS, POOLS, Kube
from tokenpools.k8s.leader import LeaderElection
from tokenpools.k8s.names import node_name
from tokenpools.processes import free_port

NS = "tenants"
POOL = {
    "metadata": {"name": "qwen"},
    "spec": {
        "model": "Qwen3-8B",
        "replicas": 1,
        "perReplica": {"tokensPerSecond": 240, "kvTokens": 16384, "concurrency": 8},
        "namespaceSelector": {},  # every namespace
    },
}


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """kopf configures the root logger for the process it runs in: put it back, so later
    tests' log captures see what they saw before."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    root.handlers[:] = handlers


@pytest.fixture
def server() -> Iterator[ServerThread]:
    srv = ServerThread().start()
    yield srv
    srv.stop()


def _kube(server: ServerThread) -> Kube:
    cfg = client.Configuration()
    cfg.host = server.url
    return Kube(client.ApiClient(cfg))


def _eventually(check: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """Wait for a condition an operator in another thread brings about (not a fixed sleep:
    it returns as soon as the condition holds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _allocatable(kube: Kube, name: str) -> dict[str, str] | None:
    node = kube.find(NODES, None, name)
    return (node or {}).get("status", {}).get("allocatable")


def test_kopf_runs_the_operator_against_the_api_server(
    server: ServerThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "stand-in",
                "clusters": [{"name": "stand-in", "cluster": {"server": server.url}}],
                "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "u"}}],
                "users": [{"name": "u", "user": {"token": "test"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))  # read by the operator's client loader
    monkeypatch.setenv("TOKENPOOLS_NAMESPACE", "tokenpools-system")
    port = free_port()
    monkeypatch.setenv("TOKENPOOLS_PROBE_PORT", str(port))
    kube = _kube(server)
    kube.create(NAMESPACES, None, {"metadata": {"name": NS}})
    args = ["run", "--all-namespaces", "--standalone", "-m", "tokenpools.k8s.kopf_operator"]
    with KopfRunner(args, timeout=60) as runner:
        kube.create(POOLS, None, POOL)
        # The Node is created first and its status patched after (as a kubelet does): wait
        # for the capacity, not just the object.
        node = _eventually(lambda: _allocatable(kube, node_name("qwen")))
        assert node is not None and node["tokenpools.io/concurrency"] == "8"
        spec = {"pool": "qwen", "serviceClass": "guaranteed", "concurrency": 4}
        kube.create(ENTITLEMENTS, NS, {"metadata": {"name": "gold"}, "spec": spec})
        labels = {o.ENTITLEMENT_LABEL: "gold"}
        pods = _eventually(lambda: kube.list(PODS, NS, labels=labels))
        assert pods and pods[0]["spec"]["priorityClassName"] == "tokenpools-guaranteed"
        lease = kube.get(LEASES, "tokenpools-system", "tokenpools-operator")
        assert lease["spec"]["holderIdentity"]
        probes = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{probes}/healthz").status_code == 200
        assert httpx.get(f"{probes}/readyz").text == "leader"
        metrics = httpx.get(f"{probes}/metrics").text
        assert (
            'tokenpools_operator_reconciles_total{kind="TokenEntitlement",result="ok"}' in metrics
        )
        assert (
            f'tokenpools_operator_node_heartbeat_age_seconds{{node="{node_name("qwen")}"}}'
            in metrics
        )
    assert runner.exit_code == 0 and runner.exception is None


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_only_one_operator_replica_leads(server: ServerThread) -> None:
    kube, clock = _kube(server), Clock()
    a = LeaderElection(kube, "tokenpools-system", "a", clock, duration_s=15)
    b = LeaderElection(kube, "tokenpools-system", "b", clock, duration_s=15)
    assert a.try_acquire() and not b.try_acquire()
    clock.now += 10
    assert a.try_acquire() and not b.try_acquire()  # renewed: still a's
    clock.now += 16  # a stopped renewing: the Lease expires and b takes it
    assert b.try_acquire() and not a.try_acquire()
    held = kube.get(LEASES, "tokenpools-system", "tokenpools-operator")["spec"]
    assert held["holderIdentity"] == "b"


def test_a_stale_write_loses_the_lease(server: ServerThread) -> None:
    # Two replicas read the free Lease at once; the second PUT carries an old resourceVersion.
    kube, clock = _kube(server), Clock()
    LeaderElection(kube, "tokenpools-system", "a", clock).try_acquire()
    clock.now += 100  # expired
    stale = kube.get(LEASES, "tokenpools-system", "tokenpools-operator")
    assert LeaderElection(kube, "tokenpools-system", "b", clock).try_acquire()
    stale["spec"]["holderIdentity"] = "c"
    from tokenpools.k8s.api import Conflict

    with pytest.raises(Conflict):
        kube.replace(LEASES, "tokenpools-system", "tokenpools-operator", stale)
