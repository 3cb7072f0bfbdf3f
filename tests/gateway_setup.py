"""What the gateway tests share: the emulator behind it, a config of three tenants (guaranteed,
spot, preemptible), the openai client, and the admin API's counters, which every test leaves
at zero."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.servers import ServerThread, wait_for
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.emulator.server import EMULATOR
from tokenpools.engine.profile import EngineProfile
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key

MODEL = "qwen3-8b"
KEYS = {
    "gold": "sk-gold", "spot": "sk-spot", "batch": "sk-batch", "team": "sk-team",
    "admin": "sk-admin",
}  # fmt: skip
FAST = EngineProfile(
    name="test",
    description="8 slots, 20 ms steps: a stream of n tokens holds its lease ~n/50 s",
    max_num_seqs=8,
    max_num_batched_tokens=2048,
    kv_blocks=4096,
    t0_s=0.02,
    prefill_s_per_token=0.00001,
    decode_s_per_seq=0.0001,
)


def config_data(backend_url: str, **policy: Any) -> dict[str, Any]:
    # backfillWindowS 0: surplus work claims nothing for the others, so these tests of the
    # gateway's mechanics (evictions, streams, leases) can fill the pool at once; the claims
    # are tests/test_preemptible_waste.py's and test_preemptible_family.py's
    return {
        "policy": {"retryAfterMinS": 1, "backfillWindowS": 0, **policy},
        "gateway": {"adminKeys": [hash_key(KEYS["admin"])], "maxBodyBytes": 65536},
        "pools": [
            {
                "name": "pool",
                "model": "Qwen3-8B",
                "servedModels": [MODEL],
                "backends": [{"url": backend_url, "timeoutS": 30}],
                "perReplica": {"tokensPerSecond": 100000, "kvTokens": 65536, "concurrency": 8},
            }
        ],
        "entitlements": [
            {"name": "gold", "tenantId": "g", "pool": "pool", "serviceClass": "guaranteed",
             "sloTargetMs": 1000, "concurrency": 4, "apiKeys": [hash_key(KEYS["gold"])]},
            {"name": "spot", "tenantId": "s", "pool": "pool", "serviceClass": "spot",
             "apiKeys": [hash_key(KEYS["spot"])]},
            {"name": "batch", "tenantId": "b", "pool": "pool", "serviceClass": "preemptible",
             "apiKeys": [hash_key(KEYS["batch"])]},
        ],
    }  # fmt: skip


@pytest.fixture
def emulator() -> Iterator[ServerThread]:
    server = ServerThread(make_emulator(FAST, speed=1.0))
    yield server
    server.stop()


@pytest.fixture
def gateway(emulator: ServerThread) -> Iterator[ServerThread]:
    gw = Gateway(parse_config(config_data(emulator.url)))
    server = ServerThread(make_app(gw, health_interval_s=0.2))
    yield server
    # Every test ends with nothing in flight and nothing reserved.
    wait_all_ended(server)
    for e in admin(server, "entitlements").values():
        assert e["reserved"] == {"concurrency": 0, "kv_tokens": 0}
    for p in admin(server, "pools").values():
        assert p["in_flight"] == 0 and p["reserved"] == {"concurrency": 0, "kv_tokens": 0}
    server.stop()


def admin(server: ServerThread, what: str, key: str = KEYS["admin"]) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/admin/{what}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def client(server: ServerThread, who: str = "gold", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[who], **kw)


def emulator_running(emulator: ServerThread) -> int:
    return int(emulator.call(lambda: emulator.app[EMULATOR].engine.num_running))


def wait_all_ended(server: ServerThread, key: str = KEYS["admin"]) -> None:
    """Wait until every admitted request has ended where the gateway keeps its state: each
    entitlement's in_flight (its leases in the store) back to 0. What a settlement charges and
    the reservation it frees come with that, so a test reads them after this, not after the
    client's answer: a stream is settled after its client has the last chunk, and on a shared
    store (Redis) a settlement is a task of its own, sent after the answer."""
    wait_for(
        lambda: {
            name: e["in_flight"]
            for name, e in admin(server, "entitlements", key).items()
            if e["in_flight"]
        },
        lambda held: not held,
        what="every entitlement's in_flight back to 0 (each lease ended)",
    )
