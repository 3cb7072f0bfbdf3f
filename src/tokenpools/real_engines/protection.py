"""The protection scenario on a real engine: a guaranteed tenant at a steady rate while a spot
tenant floods, measured client-side (TTFT at the first content chunk).

Run it against the gateway (with admission control) and straight against the engine (without)
and compare the guaranteed tenant's TTFT with its unloaded value.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tokenpools.model.keys import hash_key
from tokenpools.prompt import prompt_text

MODEL = "smollm2"
KEYS = {"gold": "sk-gold", "spot": "sk-spot"}


def gateway_config(backend: str, slots: int) -> dict[str, Any]:
    """One pool over the engine's `slots`: gold guaranteed one of them, spot the rest."""
    return {
        "policy": {"retryAfterMinS": 0.5, "overcommit": 0.1},
        "pools": [
            {
                "name": "smollm2",
                "model": "SmolLM2-135M",
                "servedModels": [MODEL],
                "backends": [{"url": backend, "timeoutS": 60}],
                # tokens/s and KV generous: the engine's slots are what binds here
                "perReplica": {"tokensPerSecond": 5000, "kvTokens": 4096, "concurrency": slots},
                # llama.cpp's server without --jinja closes a final assistant message
                # instead of continuing it
                "chatContinuation": False,
            }
        ],
        "entitlements": [
            {"name": "gold", "tenantId": "g", "pool": "smollm2", "serviceClass": "guaranteed",
             "sloTargetMs": 1000, "concurrency": 1, "apiKeys": [hash_key(KEYS["gold"])]},
            {"name": "spot", "tenantId": "s", "pool": "smollm2", "serviceClass": "spot",
             "apiKeys": [hash_key(KEYS["spot"])]},
        ],
    }  # fmt: skip


@dataclass(frozen=True)
class Load:
    seconds: float = 15.0
    gold_gap_s: float = 1.0  # the guaranteed tenant sends one request, then waits this long
    # ... and runs on past `seconds` until it has this many answers (a slow machine takes
    # longer per request: the run waits for the requests, not for the clock)
    gold_answers: int = 0
    gold_prompt: int = 100
    gold_output: int = 16
    spot_workers: int = 6  # closed loop, each retrying after a 429's Retry-After
    spot_prompt: int = 100
    spot_output: int = 64


@dataclass
class Outcome:
    gold_ttft_s: list[float] = field(default_factory=list)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)

    def ttft(self, q: float) -> float:
        ordered = sorted(self.gold_ttft_s)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    @property
    def spot_rejected_fraction(self) -> float:
        total = sum(n for (who, _), n in self.statuses.items() if who == "spot")
        return self.statuses["spot", 429] / total if total else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "guaranteed_ttft_p50_s": statistics.median(self.gold_ttft_s),
            "guaranteed_ttft_p99_s": self.ttft(99),
            "guaranteed_requests": len(self.gold_ttft_s),
            "spot_rejected_fraction": self.spot_rejected_fraction,
        }


@dataclass(frozen=True)
class Timing:
    status: int
    ttft_s: float | None = None  # at the first content chunk
    tpot_s: float | None = None  # (end − first) / (chunks − 1)
    retry_after_s: float = 0.0
    gaps_s: tuple[float, ...] = ()  # between consecutive content chunks: decode steps
    prompt_tokens: int | None = None  # as the engine counted them (template included)


async def stream(
    session: aiohttp.ClientSession, base_url: str, key: str, prompt: int, output: int, seed: str
) -> Timing:
    """One streaming chat request of ~`prompt` tokens for exactly `output` tokens."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt_text(prompt, seed)}],
        "max_tokens": output,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # exactly `output` tokens, whatever the model would say
    }
    start = time.monotonic()
    async with session.post(
        f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status != 200:
            await r.read()
            return Timing(r.status, retry_after_s=float(r.headers.get("Retry-After", "0") or 0))
        arrivals = []
        prompt_tokens = None
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            if b'"content":"' in line:
                arrivals.append(time.monotonic() - start)
            elif b'"prompt_tokens"' in line:
                usage = json.loads(line[5:]).get("usage") or {}
                prompt_tokens = usage.get("prompt_tokens")
        end = time.monotonic() - start
    if not arrivals:
        return Timing(200)
    first = arrivals[0]
    tpot = (end - first) / (len(arrivals) - 1) if len(arrivals) > 1 else None
    gaps = tuple(b - a for a, b in itertools.pairwise(arrivals))
    return Timing(200, first, tpot, gaps_s=gaps, prompt_tokens=prompt_tokens)


async def protection(base_url: str, keys: dict[str, str], load: Load) -> Outcome:
    """`keys` holds "gold" and, unless load.spot_workers is 0, "spot"."""
    out = Outcome()
    end = time.monotonic() + load.seconds
    gold_done = asyncio.Event()  # the flood lasts as long as the steady tenant
    run = secrets.token_hex(4)  # no prompt repeats an earlier run's: the cache would hit
    ids = (f"{run}-{i}" for i in itertools.count())

    async def client(
        session: aiohttp.ClientSession, tenant: str, prompt: int, output: int, steady: bool
    ) -> None:
        """Steady: a pause after every request. Otherwise a flood: pause only when refused,
        for its Retry-After (at most 1 s, to keep the pressure on)."""

        def running() -> bool:
            if not steady:
                return not gold_done.is_set()
            return time.monotonic() < end or len(out.gold_ttft_s) < load.gold_answers

        while running():
            t = await stream(session, base_url, keys[tenant], prompt, output, next(ids))
            out.statuses[tenant, t.status] += 1
            if steady and t.ttft_s is not None:
                out.gold_ttft_s.append(t.ttft_s)
            if steady:
                await asyncio.sleep(load.gold_gap_s)
            elif t.status != 200:
                await asyncio.sleep(min(t.retry_after_s, 1.0) or 0.2)
        if steady:
            gold_done.set()

    timeout = aiohttp.ClientTimeout(total=120)
    # llama.cpp's server closes idle keep-alive connections without notice: one per request
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        gold = client(session, "gold", load.gold_prompt, load.gold_output, steady=True)
        spot = (
            client(session, "spot", load.spot_prompt, load.spot_output, steady=False)
            for _ in range(load.spot_workers)
        )
        await asyncio.gather(gold, *spot)
    return out
