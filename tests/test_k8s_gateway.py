"""`serve --kubernetes`: the gateway takes each object as the operator applied it, with the
binding the operator wrote, backend credentials only from the platform namespace's Secrets
(the labelled ones: tests/test_k8s_ownership.py),
and watches that list again on 410 Gone and report themselves stale on /readyz."""

from __future__ import annotations

import base64
import os
import threading
from pathlib import Path

import httpx
import pytest

from tests.kube.harness import NS, PLATFORM, TENANT_LABEL, Bench, bench, ent, pool
from tests.servers import wait_until
from tokenpools.control.tenancy import Caller, Directory
from tokenpools.k8s.api import ENTITLEMENTS, POOLS, SECRETS
from tokenpools.k8s.informer import Informer
from tokenpools.k8s.source import ClusterSource, cluster_config
from tokenpools.model.keys import hash_key

__all__ = ["bench"]


def _keyed(name: str, cls: str, slots: float, **extra: object) -> dict[str, object]:
    return ent(name, cls, slots, apiKeyHashes=[hash_key(f"sk-{name}")], **extra)


def test_the_gateway_takes_the_binding_the_operator_wrote(bench: Bench) -> None:
    from tokenpools.control.core import DecisionCore
    from tokenpools.control.decisions import Admit, Reject
    from tokenpools.model.request import RequestCost
    from tokenpools.state.memory import MemoryStore

    kube = bench.kube
    kube.create(POOLS, None, pool(replicas=2))
    kube.create(ENTITLEMENTS, NS, _keyed("gold", "guaranteed", 6))
    kube.create(ENTITLEMENTS, NS, _keyed("chat", "elastic", 14))
    bench.settle()
    kube.create(ENTITLEMENTS, NS, ent("gold2", "guaranteed", 6))
    bench.settle()  # 6 + 6 + 14 shared > 24: chat is preempted
    assert bench.states() == {"gold": "Bound", "chat": "Degraded", "gold2": "Bound"}

    # chat edits itself to a class that would preempt: the operator has not looked yet
    kube.patch(ENTITLEMENTS, NS, "chat", {"spec": {"serviceClass": "dedicated"}})
    source = ClusterSource(kube, PLATFORM, {}).start()
    core = DecisionCore(source.config(), MemoryStore(), now=0.0)
    source.stop()
    key = Directory(core.config).by_key("sk-gold", 0.0)
    assert isinstance(key, Caller) and key.entitlement == f"{NS}/gold" and key.tenant == NS
    cost = RequestCost(input_tokens=64, max_output_tokens=64)
    assert isinstance(core.admit(f"{NS}/gold", cost, now=0.0), Admit)
    refused = core.admit(f"{NS}/chat", cost, now=0.0)
    assert isinstance(refused, Reject) and refused.reason == "entitlement_degraded"
    assert core.config.entitlements[f"{NS}/chat"].service_class.value == "elastic"


def test_backend_keys_come_only_from_the_platform_namespace(bench: Bench) -> None:
    kube = bench.kube
    ref = {"url": "http://127.0.0.1:9", "apiKeySecretRef": {"name": "vllm-key"}}
    kube.create(POOLS, None, pool(backends=[ref]))
    bench.settle()
    secret = {"metadata": {"name": "vllm-key", "labels": {"tokenpools.io/backend-key": "true"}},
              "data": {"apiKey": base64.b64encode(b"backend-secret\n").decode()}}  # fmt: skip
    kube.create(SECRETS, NS, secret)  # a tenant's Secret of that name is never read
    pools = kube.list(POOLS)
    try:
        cluster_config(pools, [], kube.list(SECRETS, PLATFORM))
        raise AssertionError("a missing platform Secret must be refused")
    except ValueError as exc:
        assert "vllm-key" in str(exc)
    kube.create(SECRETS, PLATFORM, secret)
    [backend] = cluster_config(pools, [], kube.list(SECRETS, PLATFORM)).pools["qwen"].backends
    assert backend.api_key == "backend-secret" and backend.api_key_file is None


def test_serve_kubernetes_follows_the_cluster_over_http(bench: Bench) -> None:
    from tests.gateway_setup import FAST
    from tests.servers import ServerThread as HttpServer
    from tokenpools.emulator.app import make_app as make_emulator
    from tokenpools.gateway.server import build_kubernetes

    kube = bench.kube
    emulator = HttpServer(make_emulator(FAST, speed=1.0))
    backends = {"backends": [{"url": emulator.url}], "servedModels": ["qwen3-8b"]}
    kube.create(POOLS, None, pool(replicas=2, **backends))
    kube.create(ENTITLEMENTS, NS, _keyed("gold", "guaranteed", 6))
    kube.create(ENTITLEMENTS, NS, _keyed("chat", "elastic", 14))
    bench.settle()
    kube.create(ENTITLEMENTS, NS, ent("gold2", "guaranteed", 6))
    bench.settle()
    assert bench.states()["chat"] == "Degraded"

    gateway = HttpServer(build_kubernetes(kube, PLATFORM))
    body = {"model": "qwen3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    def ask(who: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer sk-{who}"}
        return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers)

    try:
        assert ask("gold").status_code == 200
        refused = ask("chat")
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        assert refused.json()["error"]["code"] == "entitlement_degraded"
        assert httpx.get(f"{gateway.url}/readyz").status_code == 200
        # The scheduler's decision changes (gold2 leaves, chat binds): the gateway follows.
        kube.delete(ENTITLEMENTS, NS, "gold2")
        bench.settle()
        assert bench.states()["chat"] == "Bound"
        wait_until(lambda: ask("chat").status_code == 200)
    finally:
        gateway.stop()
        emulator.stop()


def test_an_informer_resumes_its_watch_and_lists_again_on_410(bench: Bench) -> None:
    kube = bench.kube
    kube.create(POOLS, None, pool("before"))
    changes = threading.Semaphore(0)
    informer = Informer(kube, POOLS, None, changes.release, watch_timeout_s=1).start()
    try:
        assert informer.synced.wait(10)
        assert [p["metadata"]["name"] for p in informer.items()] == ["before"]
        kube.create(POOLS, None, pool("after", servedModels=["after"]))
        kube.patch(POOLS, None, "before", {"spec": {"replicas": 3}})
        wait_until(lambda: {p["metadata"]["name"]: p["spec"]["replicas"] for p in informer.items()}
                   == {"before": 3, "after": 2})  # fmt: skip
        kube.delete(POOLS, None, "after")
        wait_until(lambda: [p["metadata"]["name"] for p in informer.items()] == ["before"])
        # the watch stream ends every second; the informer resumes it without listing again
        wait_until(lambda: _watches(bench) >= 3)
        assert informer.lists == 1
        # etcd compacts past the informer's version: 410 Gone, and it lists again
        bench.namespace("elsewhere")  # history moves on past what the informer has seen
        bench.server.call(_compact(bench))  # its next resume is refused
        wait_until(lambda: informer.lists == 2)
        kube.patch(POOLS, None, "before", {"spec": {"replicas": 1}})
        wait_until(lambda: informer.items()[0]["spec"]["replicas"] == 1)
    finally:
        informer.stop()


async def _compact(bench: Bench) -> None:
    bench.server.api.compact()


def _watches(bench: Bench) -> int:
    gets = [r for r in list(bench.server.api) if r.url.path.endswith("/tokenpools")]
    return sum(1 for r in gets if r.params.get("watch") == "true")


def test_a_watch_without_answers_makes_the_source_unready(bench: Bench) -> None:
    from tests.kube.api_faults import Fault

    now = [0.0]
    source = ClusterSource(bench.kube, PLATFORM, {}, lambda: now[0], watch_timeout_s=1).start()
    try:
        assert source.stale() == []
        bench.server.api.faults.append(Fault("*", "tokenentitlements", status=503))
        bench.namespace("elsewhere")
        bench.server.call(_compact(bench))  # every informer must list again, and cannot
        wait_until(lambda: any(i.failing_since is not None for i in source._informers))
        now[0] += 31
        assert any("tokenentitlements" in s for s in source.stale())
    finally:
        source.stop()


def test_budgets_in_the_gateways_config_apply_to_cluster_tenants_once_they_exist(
    bench: Bench,
) -> None:
    """Budgets are the platform's: they live in the gateway's own config beside the cluster's
    objects. One naming a namespace or entitlement not there yet is set aside (the cluster's
    config stays valid) and applies once it is."""

    kube = bench.kube
    kube.create(POOLS, None, pool(replicas=2))
    kube.create(ENTITLEMENTS, NS, _keyed("gold", "guaranteed", 6))
    bench.settle()
    base = {"budgets": [
        {"name": "ns-day", "tenant": NS, "limit": 1000, "window": "day"},
        {"name": "gold-life", "entitlement": f"{NS}/gold", "limit": 5000, "window": "lifetime"},
        {"name": "later", "tenant": "team-not-yet", "limit": 10},
        {"name": "later-ent", "entitlement": f"{NS}/not-yet", "limit": 10},
    ]}  # fmt: skip
    _gold_stopped_by_its_day_budget(bench, base)


def test_token_budgets_are_applied_by_the_operator_and_enforced_by_the_gateway(
    bench: Bench,
) -> None:
    """A TokenBudget (cluster-scoped, the platform's): the operator applies a valid one
    (Ready, its appliedSpec), refuses an invalid one and sets aside one whose tenant is not in
    the cluster yet, each saying why in its conditions; the gateway enforces what was applied."""
    from tokenpools.k8s.api import BUDGETS
    from tokenpools.k8s.schema import API_VERSION

    def budget(name: str, **spec: object) -> dict[str, object]:
        return {"apiVersion": API_VERSION, "kind": "TokenBudget", "metadata": {"name": name},
                "spec": spec}  # fmt: skip

    def ready(name: str) -> tuple[str, str]:
        status = bench.kube.get(BUDGETS, None, name).get("status") or {}
        cond = next(c for c in status.get("conditions", []) if c["type"] == "Ready")
        return cond["status"], cond["message"]

    kube = bench.kube
    kube.create(POOLS, None, pool(replicas=2))
    kube.create(ENTITLEMENTS, NS, _keyed("gold", "guaranteed", 6))
    kube.create(BUDGETS, None, budget("ns-day", tenant=NS, limit=1000, window="day"))
    kube.create(BUDGETS, None, budget("gold-life", entitlement=f"{NS}/gold", limit=5000,
                                      window="lifetime"))  # fmt: skip
    kube.create(BUDGETS, None, budget("later", tenant="team-x", limit=10))
    kube.create(BUDGETS, None, budget("both", tenant=NS, entitlement=f"{NS}/gold", limit=5))
    bench.settle()
    assert ready("ns-day")[0] == "True" and ready("gold-life")[0] == "True"
    assert ready("later") == ("False", "its tenant, entitlement or key is not in the cluster (yet)")
    assert ready("both")[0] == "False" and "exactly one of tenant" in ready("both")[1]
    applied = kube.get(BUDGETS, None, "ns-day")["status"]["appliedSpec"]
    assert applied == {"tenant": NS, "limit": 1000, "window": "day"}

    _gold_stopped_by_its_day_budget(bench, {})

    # the tenant's namespace appears: the budget set aside applies at the next pass
    bench.namespace("team-x", TENANT_LABEL)
    kube.create(ENTITLEMENTS, "team-x", _keyed("x", "spot", 0))
    bench.settle()
    assert ready("later")[0] == "True"


def _gold_stopped_by_its_day_budget(bench: Bench, base: dict[str, object]) -> None:
    """The gateway's config from the cluster holds gold-life and ns-day (nothing set aside),
    and gold's second request is refused by ns-day, named."""
    from tokenpools.control.core import DecisionCore
    from tokenpools.control.decisions import Admit, Reject
    from tokenpools.model.request import Account, RequestCost
    from tokenpools.state.memory import MemoryStore

    source = ClusterSource(bench.kube, PLATFORM, base).start()
    config = source.config()
    source.stop()
    assert sorted(config.budgets) == ["gold-life", "ns-day"]
    core = DecisionCore(config, MemoryStore(), now=0.0)
    account = Account(NS, f"{NS}/gold", "m")
    first = core.admit(f"{NS}/gold", RequestCost(200, 600, 1, account), 0.0)
    assert isinstance(first, Admit) and first.budget is not None and first.budget[0] == "ns-day"
    refused = core.admit(f"{NS}/gold", RequestCost(200, 600, 1, account), 0.0)
    assert isinstance(refused, Reject) and refused.budget == "ns-day"


def test_the_file_beside_the_cluster_is_followed_and_may_not_name_pools(
    bench: Bench, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """k8s/following.py, for serve and extproc alike: the file's budgets are adopted when it
    changes; a version that names pools is logged and the running config kept."""
    import asyncio

    import yaml

    from tokenpools.k8s.following import base_of, follow_cluster
    from tokenpools.model.config import Config

    kube = bench.kube
    kube.create(POOLS, None, pool(replicas=2))
    kube.create(ENTITLEMENTS, NS, _keyed("gold", "guaranteed", 6))
    bench.settle()
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump({"state": {"backend": "memory"}}))
    adopted: list[Config] = []

    class Host:
        async def reload(self, config: Config) -> Config:
            adopted.append(config)
            return config

    def write(data: dict[str, object], stamp: int) -> None:
        path.write_text(yaml.safe_dump(data))
        os.utime(path, ns=(stamp, stamp))  # a new modification time, whatever the clock

    async def scenario() -> None:
        source = ClusterSource(kube, PLATFORM, base_of(path)).start()
        task = asyncio.create_task(follow_cluster(source, Host(), path, interval_s=0.01))
        try:
            while not adopted:
                await asyncio.sleep(0.01)
            assert adopted[-1].budgets == {}
            day = {"name": "ns-day", "tenant": NS, "limit": 1000, "window": "day"}
            write({"budgets": [day]}, 1)
            while "ns-day" not in adopted[-1].budgets:
                await asyncio.sleep(0.01)
            count = len(adopted)
            write({"budgets": [], "pools": []}, 2)  # refused: the running config kept
            while "config file rejected" not in caplog.text:
                await asyncio.sleep(0.01)
            write({"budgets": [{**day, "limit": 5}]}, 3)
            while adopted[-1].budgets["ns-day"].limit != 5:
                await asyncio.sleep(0.01)
            assert all("ns-day" in c.budgets for c in adopted[count:])
        finally:
            task.cancel()
            source.stop()

    asyncio.run(asyncio.wait_for(scenario(), 20))
    try:
        base_of(path.with_name("pools.yaml"))
        raise AssertionError("a missing file must be refused")
    except ValueError as exc:
        assert "pools.yaml" in str(exc)
    path.write_text(yaml.safe_dump({"entitlements": [], "pools": []}))
    try:
        base_of(path)
        raise AssertionError("a file naming pools must be refused")
    except ValueError as exc:
        assert "pools and entitlements come from the cluster" in str(exc)
