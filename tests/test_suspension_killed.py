"""A gateway killed (SIGKILL) while it holds suspended requests, on Redis beside a second
gateway: every client of the killed one gets a prompt connection error (no hang), the pool's
leases come back within the lease TTL (the survivor's tick expires them), each request is
charged once (a suspended one what it streamed, a running one its reservation when it
expires; no continuation booked), no counter goes negative, and the survivor admits lent work
again.

Real processes on loopback: redis-server, the emulator, two `tokenpools serve`."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from tests.servers import wait_for
from tests.test_replicas import negative_counters
from tokenpools.model.keys import hash_key
from tokenpools.processes import redis_server, spawn_server, stop

TTL_S = 2.0
MAX_TOKENS = 3000  # long enough that nothing ends before the kill
KEYS = {"gold": "sk-gold", "batch": "sk-batch", "admin": "sk-admin"}


def config(backend: str, redis_url: str) -> dict[str, Any]:
    return {
        "state": {"backend": "redis", "url": redis_url, "timeoutMs": 500},
        "policy": {"leaseTtlS": TTL_S, "backfillWindowS": 0, "retryAfterMinS": 0.2,
                   "suspendDeadlineS": {"preemptible": 600}},
        "gateway": {"adminKeys": [hash_key(KEYS["admin"])]},
        "pools": [{"name": "p", "model": "Llama-3.1-8B", "servedModels": ["m"],
                   "backends": [{"url": backend, "timeoutS": 60}],
                   "perReplica": {"tokensPerSecond": 1e6, "kvTokens": 1e6, "concurrency": 8}}],
        "entitlements": [
            {"name": "gold", "tenantId": "g", "pool": "p", "serviceClass": "guaranteed",
             "sloTargetMs": 1000, "concurrency": 4, "apiKeys": [hash_key(KEYS["gold"])]},
            {"name": "batch", "tenantId": "b", "pool": "p", "serviceClass": "preemptible",
             "apiKeys": [hash_key(KEYS["batch"])]},
        ],
        "budgets": [{"name": "b-out", "tenant": "b", "limit": 10**9, "measure": "output"}],
    }  # fmt: skip


class Client:
    """One streamed request read in a thread: whether it began, the tokens it received (the
    emulator streams one per event), and how it ended."""

    def __init__(self, url: str, who: str) -> None:
        self.began = threading.Event()
        self.ended = threading.Event()
        self.broken: Exception | None = None
        self.tokens = 0
        body = {"model": "m", "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "messages": [{"role": "user", "content": "go"}]}  # fmt: skip

        def read() -> None:
            headers = {"Authorization": f"Bearer {KEYS[who]}"}
            request = httpx.Request(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers
            )
            try:
                with httpx.Client(timeout=60) as http:
                    response = http.send(request, stream=True)
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.began.set()
                            self.tokens += '"content":"tok' in line.replace(" ", "")
            except httpx.HTTPError as exc:
                self.broken = exc
            self.began.set()
            self.ended.set()

        threading.Thread(target=read, daemon=True).start()
        assert self.began.wait(15), "no first event"


def batch_ledger(r: redis.Redis) -> dict[str, float]:
    """The batch tenant's usage-ledger rows in Redis, summed."""
    totals: dict[str, float] = {}
    for key in r.scan_iter("tokenpools:{p}:u:*"):
        if b"\x1fbatch\x1f" in key:
            for field, value in r.hgetall(key).items():
                totals[field.decode()] = totals.get(field.decode(), 0.0) + float(value)
    return totals


def test_a_gateway_killed_with_requests_suspended_leaves_nothing_behind(tmp_path: Path) -> None:
    with redis_server() as (redis_url, _):
        path = tmp_path / "gateway.yaml"

        async def start() -> list[Any]:
            emulate = ["emulate", "--profile", "h100-llama3.1-8b", "--speed", "1", "--port"]
            emulator = await spawn_server(lambda p: [*emulate, str(p)], "/health")
            path.write_text(yaml.safe_dump(config(emulator[1], redis_url)))
            serve = [
                await spawn_server(
                    lambda p: ["serve", "--config", str(path), "--port", str(p)], "/readyz"
                )
                for _ in range(2)
            ]
            return [emulator, *serve]

        (emulator, _), (killed, url), (survivor, other) = asyncio.run(start())
        r = redis.Redis.from_url(redis_url)
        try:
            batch = [Client(url, "batch") for _ in range(8)]
            gold = [Client(url, "gold") for _ in range(4)]  # takes back the four newest
            wait_for(
                lambda: metric(url, "tokenpools_evicted_total"),
                lambda n: n == 4,
                what="four batch streams taken back (suspended: their clients wait)",
            )
            assert not any(c.ended.is_set() for c in batch)

            # the four newest were taken back: each is charged what it streamed at once, the
            # four running ones hold their reservations (what the clients read is counted
            # with the budget: their readers may still be parsing the last chunks written)
            def charged() -> tuple[int, int, int]:
                budget = admin(other, "budgets")["budgets"][0]
                return budget["used"], budget["held"], sum(c.tokens for c in batch[4:])

            streamed, _, _ = wait_for(
                charged,
                lambda v: v[0] == v[2] and v[1] == 4 * MAX_TOKENS,
                what="the suspended streams charged what they streamed",
            )
            killed.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            for c in [*batch, *gold]:
                assert c.ended.wait(10), "a client of the killed gateway hung"
                assert c.broken is not None  # a connection error, not an answer
            wait_for(lambda: int(r.hget("tokenpools:{p}", "leases") or 0), lambda n: n == 0,
                     what="every lease expired", timeout_s=TTL_S + 15)  # fmt: skip
            back_s = time.monotonic() - killed_at
            assert back_s <= TTL_S + 3.0  # the TTL, the survivor's tick and its staleness check
            assert not negative_counters(r)
            # each batch request charged once: the four taken back what they streamed, the four
            # that expired their whole reservations; no continuation booked
            ledger = batch_ledger(r)
            assert ledger["requests"] == 8
            assert (ledger.get("evicted", 0), ledger.get("expired", 0)) == (4, 4)
            assert ledger["output"] == streamed + 4 * MAX_TOKENS
            (budget,) = admin(other, "budgets")["budgets"]
            assert (budget["used"], budget["held"]) == (streamed + 4 * MAX_TOKENS, 0)
            # the survivor lends the freed room again
            reply = httpx.post(
                f"{other}/v1/chat/completions",
                json={
                    "model": "m",
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "x"}],
                },
                headers={"Authorization": f"Bearer {KEYS['batch']}"},
                timeout=30,
            )
            assert reply.status_code == 200, reply.text
            print(f"every lease back {back_s:.2f} s after the kill (leaseTtlS {TTL_S:g})")
        finally:
            if killed.poll() is None:
                killed.kill()
            stop(survivor, emulator)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


def admin(url: str, what: str) -> dict[str, Any]:
    reply = httpx.get(f"{url}/admin/{what}", headers={"Authorization": f"Bearer {KEYS['admin']}"})
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data
