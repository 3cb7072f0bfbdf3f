"""A budget is never overspent by three gateway replicas on one Redis: 64 concurrent clients
of the official (async) openai client — whole answers, streams, n > 1, clients that hang up
mid-stream — against a 50,000-token budget. A sampler reads the budget's counter in Redis
every 10 ms: used + held never above the limit. At the end nothing is held, the budget is
spent down to less than the largest single reservation, and what it charged is what the
ledger recorded. Again with one replica killed with SIGKILL mid-run: its leases are charged
by the expiry rule, and still nothing is overspent."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml

from tokenpools.model.keys import hash_key
from tokenpools.processes import redis_server, spawn_server, stop

LIMIT = 50_000
MAX_TOKENS = 120  # × n ≤ 2, plus a prompt of at most 40 tokens: the largest reservation
LARGEST = 40 + 2 * MAX_TOKENS
COUNTER = "tokenpools:{p}:b:acme-total@lifetime"


def config(backend: str, redis_url: str) -> dict[str, Any]:
    return {
        "state": {"backend": "redis", "url": redis_url, "timeoutMs": 1000, "replicaTimeoutS": 2},
        "policy": {"leaseTtlS": 2, "retryAfterMinS": 0.2},
        "gateway": {"adminKeys": [hash_key("sk-admin")]},
        "usage": {"flushIntervalS": 1},
        "pools": [{"name": "p", "model": "Llama-3.1-8B", "servedModels": ["m"],
                   "backends": [{"url": backend, "timeoutS": 30}],
                   "perReplica": {"tokensPerSecond": 1e6, "kvTokens": 1e7, "concurrency": 256}}],
        "entitlements": [{"name": "acme-e", "tenantId": "acme", "pool": "p",
                          "serviceClass": "elastic", "concurrency": 256}],
        "tenants": [{"id": "acme", "keys": [{"hash": hash_key("sk-acme"), "label": "app"}]}],
        "budgets": [{"name": "acme-total", "tenant": "acme", "limit": LIMIT, "window": "lifetime"}],
    }  # fmt: skip


async def client_loop(url: str, seed: int, seen: dict[str, Any], dead: set[str]) -> None:
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-acme", max_retries=0)
    try:
        while not seen["stop"] and url not in dead:
            n = rng.choice([1, 1, 2])
            kind = rng.choice(["whole", "stream", "hang-up"])
            prompt = [{"role": "user", "content": "count " * rng.randint(3, 15)}]
            try:
                if kind == "whole":
                    r = await client.chat.completions.create(
                        model="m",
                        messages=prompt,
                        max_tokens=MAX_TOKENS,
                        n=n,  # type: ignore[arg-type]
                    )
                    seen["usage"] += r.usage.prompt_tokens + r.usage.completion_tokens  # type: ignore[union-attr]
                else:
                    stream = await client.chat.completions.create(
                        model="m",
                        messages=prompt,
                        max_tokens=MAX_TOKENS,
                        n=n,
                        stream=True,  # type: ignore[arg-type]
                        stream_options={"include_usage": True},
                    )
                    async for chunk in stream:
                        if kind == "hang-up":
                            break
                        if chunk.usage:
                            seen["usage"] += (
                                chunk.usage.prompt_tokens + chunk.usage.completion_tokens
                            )
                    await stream.close()
                seen[kind] += 1
            except openai.RateLimitError as exc:
                assert exc.code == "insufficient_quota" or "insufficient_quota" in str(exc.body)
                seen["refused"] += 1
                await asyncio.sleep(0.05)
            except (openai.APIConnectionError, httpx.HTTPError, openai.InternalServerError):
                await asyncio.sleep(0.05)
    finally:
        await client.close()


async def run(tmp_path: Path, kill: bool) -> dict[str, Any]:
    with redis_server() as (redis_url, _):
        r = redis.Redis.from_url(redis_url)
        emulate = ["emulate", "--profile", "h100-llama3.1-8b", "--speed", "8", "--port"]
        emulator, backend = await spawn_server(lambda p: [*emulate, str(p)], "/health")
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config(backend, redis_url)))
        serve = ["serve", "--config", str(path), "--port"]
        replicas = await asyncio.gather(
            *(spawn_server(lambda p: [*serve, str(p)], "/readyz") for _ in range(3))
        )
        seen: dict[str, Any] = dict.fromkeys(["usage", "whole", "stream", "hang-up", "refused"], 0)
        seen.update(stop=False, peak=0.0)
        dead: set[str] = set()

        async def sample() -> None:
            while not seen["stop"]:
                used, held = (float(v or 0) for v in r.hmget(COUNTER, "used", "held"))
                assert used + held <= LIMIT, (used, held)
                seen["peak"] = max(seen["peak"], used + held)
                await asyncio.sleep(0.01)

        try:
            sampler = asyncio.create_task(sample())
            urls = [url for _, url in replicas]
            clients = [
                asyncio.create_task(client_loop(urls[i % 3], i, seen, dead)) for i in range(64)
            ]
            if kill:
                await asyncio.sleep(2.0)
                replicas[0][0].send_signal(signal.SIGKILL)
                dead.add(urls[0])
            # the clients go on until not even the largest request could fit any more
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                used, held = (float(v or 0) for v in r.hmget(COUNTER, "used", "held"))
                if held == 0 and LIMIT - used < LARGEST and seen["refused"] >= 64:
                    break
                await asyncio.sleep(0.1)
            seen["stop"] = True
            await asyncio.gather(*clients)
            # the killed replica's leases end by the expiry rule, charged in full
            while float(r.hget(COUNTER, "held") or 0) > 0 and time.monotonic() < deadline + 30:
                await asyncio.sleep(0.1)
            seen["stop"] = True
            await sampler
            used, held = (float(v or 0) for v in r.hmget(COUNTER, "used", "held"))
            seen.update(used=used, held=held)
            async with httpx.AsyncClient() as http:
                live = urls[1]
                answer = await http.get(
                    live + "/admin/usage", params={"per": "all"},
                    headers={"Authorization": "Bearer sk-admin"},
                )  # fmt: skip
                seen["ledger"] = answer.json()["rows"]
        finally:
            with contextlib.suppress(Exception):
                stop(*(p for p, _ in replicas if p.poll() is None), emulator)
            r.close()
    return seen


@pytest.mark.parametrize("kill", [False, True], ids=["three-replicas", "one-killed"])
def test_a_budget_is_never_overspent_by_three_replicas(
    tmp_path: Path, kill: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the replicas' one ledger
    seen = asyncio.run(run(tmp_path, kill))
    print({k: v for k, v in seen.items() if k != "ledger"})
    assert seen["held"] == 0
    assert seen["used"] <= LIMIT
    assert seen["used"] >= LIMIT - LARGEST  # less than the largest reservation left
    assert seen["whole"] and seen["stream"] and seen["hang-up"] and seen["refused"] >= 64
    (row,) = seen["ledger"]
    assert row["weighted_tokens"] == seen["used"]  # the ledger recorded what the budget charged
    # weights 1: what the budget counts is the engines' input plus output, in every measure
    assert row["input_tokens"] + row["output_tokens"] == seen["used"]
    assert row["refusals"].get("budget", 0) >= 64
    if not kill:
        # every request's charge is the engine's report, or (hung up) what was streamed
        assert seen["used"] >= seen["usage"]
