"""The capacity-feedback control law, and the gateway applying it to a saturated backend."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

from tests.gateway_setup import FAST, KEYS, admin, config_data
from tests.servers import ServerThread, wait_until
from tests.test_gateway_e2e import open_streams
from tokenpools.control.feedback import next_fraction
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.pool import CapacityFeedback

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


def open_streams_unchecked(server: ServerThread, n: int) -> list[socket.socket]:
    """Streams beyond the engine's slots, which queue in the engine. Nothing is read from
    them (their sockets are only held open): one taken back when the pool shrinks is
    suspended before its first byte, and its client waits for its headers."""
    url = urlsplit(server.url)
    body = json.dumps(
        {"model": "qwen3-8b", "messages": [{"role": "user", "content": "go"}],
         "max_tokens": 2000, "stream": True}
    ).encode()  # fmt: skip
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {KEYS['spot']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    out = []
    for _ in range(n):
        sock = socket.create_connection((url.hostname, url.port))
        sock.sendall(head.encode() + body)
        out.append(sock)
    return out
