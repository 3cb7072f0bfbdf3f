"""The protection scenario on a real engine: a guaranteed tenant at a steady rate while a spot
tenant floods, measured client-side (TTFT at the first content chunk).

Run it against the gateway (with admission control) and straight against the engine (without)
and compare the guaranteed tenant's TTFT with its unloaded value.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tokenpools.loadgen import prompt_text

MODEL = "smollm2"


@dataclass(frozen=True)
class Load:
    seconds: float = 15.0
    gold_gap_s: float = 1.0  # the guaranteed tenant sends one request, then waits this long
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


async def stream(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    prompt: int,
    output: int,
    seed: str,
) -> tuple[int, float | None, float]:
    """One streaming request: (status, TTFT or None, Retry-After)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt_text(prompt, seed)}],
        "max_tokens": output,
        "stream": True,
        "ignore_eos": True,  # exactly `output` tokens, whatever the model would say
    }
    start = time.monotonic()
    async with session.post(
        f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status != 200:
            await r.read()
            return r.status, None, float(r.headers.get("Retry-After", "0") or 0)
        ttft = None
        async for line in r.content:
            if ttft is None and line.startswith(b"data:") and b'"content":"' in line:
                ttft = time.monotonic() - start
        return 200, ttft, 0.0


async def protection(base_url: str, keys: dict[str, str], load: Load) -> Outcome:
    """`keys` holds "gold" and, unless load.spot_workers is 0, "spot"."""
    out = Outcome()
    end = time.monotonic() + load.seconds
    ids = itertools.count()

    async def gold(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            status, ttft, _ = await stream(
                session, base_url, keys["gold"], load.gold_prompt, load.gold_output,
                f"gold-{next(ids)}",
            )  # fmt: skip
            out.statuses["gold", status] += 1
            if ttft is not None:
                out.gold_ttft_s.append(ttft)
            await asyncio.sleep(load.gold_gap_s)

    async def spot(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            status, _, retry_after = await stream(
                session, base_url, keys["spot"], load.spot_prompt, load.spot_output,
                f"spot-{next(ids)}",
            )  # fmt: skip
            out.statuses["spot", status] += 1
            if status != 200:
                await asyncio.sleep(min(retry_after, 1.0) or 0.2)

    timeout = aiohttp.ClientTimeout(total=120)
    # llama.cpp's server closes idle keep-alive connections without notice: one per request
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(gold(session), *(spot(session) for _ in range(load.spot_workers)))
    return out
