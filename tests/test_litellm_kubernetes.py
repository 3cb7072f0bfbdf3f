"""The LiteLLM hook in a cluster (TOKENPOOLS_KUBERNETES_NAMESPACE): a real LiteLLM proxy whose
tokenpools config is the cluster's custom resources (from the API stand-in, as the operator
applied them) with a file beside them, so a TokenEntitlement created and deleted, and a
TokenBudget, govern what LiteLLM serves."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.gateway_setup import FAST
from tests.kube.harness import NS, PLATFORM, Bench, bench, ent, pool
from tests.servers import ServerThread, wait_until
from tests.test_extproc_kubernetes import _kubeconfig, chat
from tests.test_litellm import LITELLM, MODEL, litellm_config, start_litellm
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.k8s.api import BUDGETS, ENTITLEMENTS, POOLS
from tokenpools.k8s.schema import API_VERSION
from tokenpools.model.keys import hash_key

pytestmark = pytest.mark.litellm
__all__ = ["bench"]


@dataclass
class Proxy:
    bench: Bench
    url: str

    def ask(self, key: str, max_tokens: int = 4) -> httpx.Response:
        return chat(self.url, key, MODEL, max_tokens)


@pytest.fixture
def proxy(bench: Bench, tmp_path: Path) -> Iterator[Proxy]:
    if not LITELLM.exists():
        pytest.fail(f"{LITELLM} is missing: `make test` installs LiteLLM into .venv-litellm")
    bench.kube.create(POOLS, None, pool(replicas=2, servedModels=[MODEL]))
    bench.kube.create(ENTITLEMENTS, NS, ent("gold", "guaranteed", 4,
                                            apiKeyHashes=[hash_key("sk-gold")]))  # fmt: skip
    bench.settle()
    emulator = ServerThread(make_emulator(FAST, speed=1.0))
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"state": {"backend": "memory"}}))
    (tmp_path / "litellm.yaml").write_text(yaml.safe_dump(litellm_config(emulator.url)))
    proc, port = start_litellm(tmp_path, {
        "KUBECONFIG": str(_kubeconfig(tmp_path / "kubeconfig", bench.server.url)),
        "TOKENPOOLS_KUBERNETES_NAMESPACE": PLATFORM,
        "TOKENPOOLS_CONFIG": str(tmp_path / "base.yaml"),  # beside the cluster: the rest
    })  # fmt: skip
    try:
        yield Proxy(bench, f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(20)
        emulator.stop()


def test_the_clusters_entitlements_and_budgets_govern_litellm(proxy: Proxy) -> None:
    kube = proxy.bench.kube
    gold = proxy.ask("sk-gold")
    assert gold.status_code == 200, gold.text
    assert proxy.ask("sk-chat").status_code == 401

    kube.create(ENTITLEMENTS, NS, ent("chat", "elastic", 2, apiKeyHashes=[hash_key("sk-chat")]))
    proxy.bench.settle()
    wait_until(lambda: proxy.ask("sk-chat").status_code == 200)

    budget = {"apiVersion": API_VERSION, "kind": "TokenBudget", "metadata": {"name": "chat-day"},
              "spec": {"entitlement": f"{NS}/chat", "limit": 60, "window": "day"}}  # fmt: skip
    kube.create(BUDGETS, None, budget)
    proxy.bench.settle()
    answers: list[httpx.Response] = []

    def refused_by_the_budget() -> bool:
        answers.append(proxy.ask("sk-chat", max_tokens=8))
        return answers[-1].status_code == 429

    wait_until(refused_by_the_budget)
    assert "insufficient_quota" in answers[-1].text
    assert sum(a.status_code == 200 for a in answers) <= 6

    kube.delete(ENTITLEMENTS, NS, "chat")
    proxy.bench.settle()
    wait_until(lambda: proxy.ask("sk-chat").status_code == 401)
    assert proxy.ask("sk-gold").status_code == 200
