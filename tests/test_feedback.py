"""The capacity-feedback control law, and the gateway applying it to a saturated backend."""

from __future__ import annotations

import httpx

from tests.gateway_setup import FAST, KEYS, admin, config_data
from tests.servers import ServerThread, wait_until
from tests.test_gateway_e2e import open_streams
from tokenpools.control.feedback import next_fraction
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.pool import CapacityFeedback

_CLIENTS: list[httpx.Client] = []  # a collected client would close its streams
FB = CapacityFeedback(waiting_threshold=1, kv_threshold=0.9, decrease=0.2, increase=0.1)


def test_multiplicative_decrease_on_saturation_additive_increase_when_idle() -> None:
    assert next_fraction(1.0, waiting=3, kv_usage=0.1, fb=FB) == 0.8
    assert next_fraction(1.0, waiting=0, kv_usage=0.95, fb=FB) == 0.8
    assert next_fraction(0.5, waiting=9, kv_usage=0.1, fb=FB) == 0.5  # the floor
    assert next_fraction(0.8, waiting=0, kv_usage=0.1, fb=FB) == 0.9
    assert next_fraction(1.0, waiting=0, kv_usage=0.1, fb=FB) == 1.0
    assert next_fraction(0.8, waiting=1, kv_usage=0.1, fb=FB) == 0.8  # at the threshold: hold


def test_gateway_shrinks_a_pool_whose_backend_queues_and_recovers() -> None:
    emulator = ServerThread(make_emulator(FAST))  # 8 slots
    data = config_data(emulator.url)
    pool = data["pools"][0]
    pool["perReplica"]["concurrency"] = 16  # the capacity model overstates the engine
    pool["capacityFeedback"] = {"waitingThreshold": 1, "decrease": 0.25, "intervalS": 0.2}
    gateway = ServerThread(make_app(Gateway(parse_config(data)), health_interval_s=0.2))
    try:
        streams = open_streams(gateway, "spot", 8, max_tokens=2000)
        more = open_streams_unchecked(gateway, 8)
        wait_until(lambda: admin(gateway, "pools")["pool"]["capacity_fraction"] < 1.0)
        shrunk = admin(gateway, "pools")["pool"]
        assert shrunk["capacity"]["concurrency"] < 16
        for s in streams + more:
            s.close()
        wait_until(lambda: admin(gateway, "pools")["pool"]["capacity_fraction"] == 1.0)
    finally:
        gateway.stop()
        emulator.stop()


def open_streams_unchecked(server: ServerThread, n: int) -> list[httpx.Response]:
    """Streams beyond the engine's slots queue in the engine: they send no chunk yet."""
    http = httpx.Client(timeout=30)
    _CLIENTS.append(http)
    out = []
    for _ in range(n):
        request = http.build_request(
            "POST",
            f"{server.url}/v1/chat/completions",
            json={"model": "qwen3-8b", "messages": [{"role": "user", "content": "go"}],
                  "max_tokens": 2000, "stream": True},
            headers={"Authorization": f"Bearer {KEYS['spot']}"},
        )  # fmt: skip
        out.append(http.send(request, stream=True))
    return out
