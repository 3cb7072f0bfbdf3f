"""Elastic streams taken back through `tokenpools serve` when the pool loses capacity under
them (control/periodic.py): each is suspended while the guaranteed tenant's baseline needs the
room, and resumes into one whole answer when capacity returns."""

from __future__ import annotations

import httpx

from tests.gateway_setup import KEYS, MODEL, admin, config_data, wait_all_ended
from tests.servers import ServerThread, wait_for
from tests.test_gateway_suspension import Stream, metric
from tokenpools.gateway.app import GATEWAY, Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key
from tokenpools.model.resources import Resources
from tokenpools.openai_api import CHAT

ASK = {"messages": [{"role": "user", "content": "x"}]}


def test_elastic_streams_on_a_lost_baseline_pause_and_resume_whole(
    emulator: ServerThread,
) -> None:
    data = config_data(emulator.url)
    data["entitlements"].append(
        {"name": "team", "tenantId": "t", "pool": "pool", "serviceClass": "elastic",
         "sloTargetMs": 3000, "concurrency": 4, "apiKeys": [hash_key(KEYS["team"])]}
    )  # fmt: skip
    gw = Gateway(parse_config(data))
    server = ServerThread(make_app(gw))
    try:
        gold = [Stream(server, "gold", CHAT, {**ASK, "max_tokens": 150}) for _ in range(2)]
        team = [Stream(server, "team", CHAT, {**ASK, "max_tokens": 60}) for _ in range(4)]
        pool = server.app[GATEWAY].admission

        def team_in_flight() -> int:
            return int(admin(server, "entitlements")["team"]["in_flight"])

        assert team_in_flight() == 4
        # 8 slots → 4: gold's 2 in flight and 2 unused leave team no room
        server.call(lambda: pool.set_capacity("pool", Resources(100000, 65536, 4)))
        wait_for(team_in_flight, lambda n: n == 0, what="the four team streams taken back")
        for _ in range(2):  # gold's baseline is there at once
            reply = httpx.post(
                server.url + CHAT, json={"model": MODEL, **ASK, "max_tokens": 5},
                headers={"Authorization": f"Bearer {KEYS['gold']}"}, timeout=10,
            )  # fmt: skip
            assert reply.status_code == 200
        assert all(not s.done.is_set() for s in team)  # still waiting, connections open
        server.call(lambda: pool.set_capacity("pool", Resources(100000, 65536, 8)))
        for s in team:
            assert s.text(CHAT) == "tok " * 60  # one whole answer each
            assert s.events.count("[DONE]") == 1
            assert not any('"error"' in e for e in s.events)
        for g in gold:
            assert g.text(CHAT) == "tok " * 150
        wait_all_ended(server)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric(metrics, "tokenpools_suspended_total", "team") == 4
    finally:
        server.stop()
