"""`tokenpools extproc --kubernetes`, the process as a cluster runs it, through a real Envoy:
its config is the cluster's custom resources (as the operator applied them, from the API
stand-in) with a file beside them, so a TokenEntitlement created, edited (its key rotated) and
deleted, and a TokenBudget, govern the requests Envoy passes; a file that names pools or
entitlements is refused, naming them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.envoy_setup import Envoy, LoopThread, Picker, start_envoy, start_grpc
from tests.gateway_setup import FAST, MODEL
from tests.kube.harness import NS, PLATFORM, Bench, bench, ent, pool
from tests.servers import ServerThread, wait_until
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.k8s.api import BUDGETS, ENTITLEMENTS, POOLS
from tokenpools.k8s.schema import API_VERSION
from tokenpools.model.keys import hash_key
from tokenpools.processes import free_port, spawn, wait_ready

__all__ = ["bench"]


def _keyed(name: str, cls: str, slots: float, key: str) -> dict[str, object]:
    return ent(name, cls, slots, apiKeyHashes=[hash_key(key)])


def _kubeconfig(path: Path, server_url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": server_url}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "test"}}],
    }))  # fmt: skip
    return path


@dataclass
class Cluster:
    bench: Bench
    envoy: Envoy
    metrics_url: str

    def ask(self, key: str, max_tokens: int = 4) -> httpx.Response:
        return chat(self.envoy.url, key, MODEL, max_tokens)


def chat(url: str, key: str, model: str, max_tokens: int) -> httpx.Response:
    """A chat completion with `key`, as a tenant's client sends it."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


@pytest.fixture
def cluster(bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "kubeconfig", bench.server.url)))
    bench.kube.create(POOLS, None, pool(replicas=2, servedModels=[MODEL]))
    bench.kube.create(ENTITLEMENTS, NS, _keyed("gold", "guaranteed", 4, "sk-gold"))
    bench.settle()
    base = tmp_path / "base.yaml"  # beside the cluster: the rest (here the store and a log)
    base.write_text(yaml.safe_dump({"state": {"backend": "memory"}, "gateway": {}}))
    grpc_port, http_port = free_port(), free_port()
    proc = spawn(["extproc", "--kubernetes", "--namespace", PLATFORM, "--config", str(base),
                  "--port", str(grpc_port), "--metrics-port", str(http_port)])  # fmt: skip
    servers = [ServerThread(make_emulator(FAST, speed=1.0)) for _ in range(2)]
    loop = LoopThread()
    picker_server, picker_port = loop.run(start_grpc(Picker([s.url[7:] for s in servers])))
    envoy = None
    try:
        metrics_url = f"http://127.0.0.1:{http_port}"
        asyncio.run(wait_ready(f"{metrics_url}/readyz", proc, timeout_s=30))
        envoy = start_envoy(grpc_port, picker_port)
        yield Cluster(bench, envoy, metrics_url)
    finally:
        if envoy is not None:
            envoy.stop()
        proc.terminate()
        proc.wait(10)
        loop.run(picker_server.stop(0))
        loop.stop()
        for s in servers:
            s.stop()


def _code(answer: httpx.Response) -> str | None:
    return answer.json().get("error", {}).get("code") if answer.status_code != 200 else None


def test_entitlements_created_edited_and_deleted_govern_the_envoy_path(cluster: Cluster) -> None:
    kube = cluster.bench.kube
    gold = cluster.ask("sk-gold")
    assert gold.status_code == 200, gold.text
    assert gold.headers["x-tokenpools-entitlement"] == f"{NS}/gold"
    assert gold.headers["x-tokenpools-service-class"] == "guaranteed"
    assert cluster.ask("sk-chat").status_code == 401  # no entitlement holds that key yet

    kube.create(ENTITLEMENTS, NS, _keyed("chat", "elastic", 2, "sk-chat"))
    cluster.bench.settle()  # the operator applies it and kube-scheduler binds it
    wait_until(lambda: cluster.ask("sk-chat").status_code == 200)
    assert cluster.ask("sk-chat").headers["x-tokenpools-service-class"] == "elastic"

    # edited: the key rotated; the old one stops, the new one works
    kube.patch(ENTITLEMENTS, NS, "chat", {"spec": {"apiKeyHashes": [hash_key("sk-chat-2")]}})
    cluster.bench.settle()
    wait_until(lambda: cluster.ask("sk-chat").status_code == 401)
    assert cluster.ask("sk-chat-2").status_code == 200

    kube.delete(ENTITLEMENTS, NS, "chat")
    cluster.bench.settle()
    wait_until(lambda: cluster.ask("sk-chat-2").status_code == 401)
    assert cluster.ask("sk-gold").status_code == 200  # the rest untouched
    assert httpx.get(f"{cluster.metrics_url}/readyz").status_code == 200


def test_a_token_budget_governs_the_envoy_path(cluster: Cluster) -> None:
    budget = {"apiVersion": API_VERSION, "kind": "TokenBudget", "metadata": {"name": "gold-day"},
              "spec": {"entitlement": f"{NS}/gold", "limit": 60, "window": "day"}}  # fmt: skip
    cluster.bench.kube.create(BUDGETS, None, budget)
    cluster.bench.settle()
    spent: list[httpx.Response] = []

    def refused_by_the_budget() -> bool:
        spent.append(cluster.ask("sk-gold", max_tokens=8))
        return _code(spent[-1]) == "insufficient_quota"

    wait_until(refused_by_the_budget)
    last = spent[-1]
    assert last.status_code == 429 and last.headers["x-tokenpools-budget"] == "gold-day"
    assert int(last.headers["retry-after"]) >= 1
    # the budget was in force within a few requests of 60 tokens, not ignored until later
    assert sum(a.status_code == 200 for a in spent) <= 6

    cluster.bench.kube.delete(BUDGETS, None, "gold-day")
    cluster.bench.settle()
    wait_until(lambda: cluster.ask("sk-gold").status_code == 200)


def test_a_file_beside_the_cluster_may_not_name_pools_or_entitlements(
    bench: Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path / "kubeconfig", bench.server.url)))
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"pools": [], "state": {"backend": "memory"}}))
    command = ["extproc", "--kubernetes", "--config", str(base), "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "tokenpools.cli", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "pools come from the cluster with --kubernetes" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_stale_watch_makes_the_processor_unready() -> None:
    """The source's staleness (tests/test_k8s_gateway.py makes a watch stale) reaches the
    processor's /readyz and its gRPC readiness, with the reason."""
    from tests.gateway_setup import config_data
    from tokenpools.extproc import Processor, start
    from tokenpools.model.config import parse_config

    stale: list[str] = []
    processor = Processor(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
    processor.ready_checks.append(lambda: list(stale))
    loop = LoopThread()
    running = loop.run(start(processor, port=0, http_port=0))
    try:
        readyz = f"http://127.0.0.1:{running.http_port}/readyz"
        assert httpx.get(readyz).status_code == 200
        stale.append("the watch of tokenentitlements has had no answer for 31 s")
        answer = httpx.get(readyz)
        assert answer.status_code == 503 and "tokenentitlements" in answer.text
        assert loop.run(processor.ready()) is False
        stale.clear()
        assert loop.run(processor.ready()) is True
    finally:
        loop.run(running.stop(0.5))
        loop.stop()
