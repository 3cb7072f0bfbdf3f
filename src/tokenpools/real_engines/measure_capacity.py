"""Measure one replica's capacity on a running OpenAI-compatible server: a pool's `perReplica`.

Method (docs/sizing.md). N streams in closed loop, for N = 1, 2, 4, … (each stream sends a
streaming chat request of a fixed prompt and exactly `output` tokens, `ignore_eos`, and the next
as soon as the last ends), a few rounds per level. A round's throughput is the tokens the pool
would charge — input × the input weight + output × the output weight, as the engine counted
them — over the round's wall time; the level's TTFT percentile is over every request of its
rounds. The sweep stops at the first level whose TTFT percentile misses the SLO; the highest
level that met it gives `concurrency`, and its median throughput `tokensPerSecond`, with the
spread of its rounds as the uncertainty. KV is what the engine reports (vLLM's
`vllm:cache_config_info`, llama.cpp's /props), or what the caller gives.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tokenpools.prompt import prompt_text


class MeasureError(Exception):
    """What went wrong, said for the person running the command."""


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 256
    output_tokens: int = 128
    requests: int = 4  # per stream and round
    rounds: int = 3
    input_weight: float = 1.0  # the pool's tokenWeights: what its throughput bucket charges
    output_weight: float = 1.0
    timeout_s: float = 300.0  # one request, end to end


@dataclass(frozen=True)
class Kv:
    tokens: int | None
    gib: float | None
    source: str


@dataclass
class Level:
    streams: int
    tokens_per_s: list[float] = field(default_factory=list)  # one per round
    ttft_s: list[float] = field(default_factory=list)  # every request of every round
    prompt_tokens: list[int] = field(default_factory=list)  # as the engine counted them
    output_tokens: list[int] = field(default_factory=list)

    def ttft_ms(self, q: float) -> float:
        """Nearest-rank percentile: with few requests, the slowest of them (conservative)."""
        ordered = sorted(self.ttft_s)
        return 1000 * ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def spread(self) -> tuple[float, float]:
        """The slowest and the fastest round, as fractions of the median (-0.03, 0.02)."""
        return min(self.tokens_per_s) / self.median - 1, max(self.tokens_per_s) / self.median - 1


@dataclass
class Capacity:
    url: str
    model: str
    slo_ms: float
    percentile: float
    workload: Workload
    kv: Kv
    slots: int | None  # the engine's own sequence limit, where it says (llama.cpp)
    levels: list[Level]
    chosen: Level
    planned: list[int]

    def meets(self, level: Level) -> bool:
        return level.ttft_ms(self.percentile) <= self.slo_ms


def default_levels(most: int, slots: int | None) -> list[int]:
    """1, 2, 4, … up to `most`; not above the engine's slots, which are a level of their own:
    more streams than slots queue inside the engine, where no admission control can help."""
    top = most if slots is None else min(most, slots)
    levels = [2**i for i in range(top.bit_length()) if 2**i <= top]
    return levels if levels[-1] == top else [*levels, top]


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    try:
        async with session.get(url) as r:
            return r.status, await r.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise MeasureError(f"cannot reach {url}: {exc or type(exc).__name__}") from None


async def served_models(session: aiohttp.ClientSession, base: str) -> list[str]:
    status, body = await _get(session, f"{base}/v1/models")
    names: list[str] = []
    try:
        if status == 200:
            data = json.loads(body)["data"]
            names = [str(m["id"]) for m in data]
            names += [str(a) for m in data for a in m.get("aliases") or []]  # llama.cpp's
    except (ValueError, KeyError, TypeError):
        names = []
    if status in (401, 403):
        raise MeasureError(f"{base} wants an API key (GET /v1/models: {status}): --api-key-env")
    if status != 200 or not names:
        raise MeasureError(
            f"{base} is not an OpenAI-compatible server: GET /v1/models answered {status} "
            f"{body[:120]!r} (give the engine's base URL, without /v1)"
        )
    return names


def vllm_kv(metrics: str) -> Kv | None:
    """vLLM exports its cache config as the labels of `vllm:cache_config_info`."""
    try:
        for family in text_string_to_metric_families(metrics):
            for sample in family.samples:
                if sample.name == "vllm:cache_config_info":
                    blocks = int(sample.labels["num_gpu_blocks"])
                    size = int(sample.labels["block_size"])
                    source = f"vLLM /metrics: {blocks} blocks x {size} tokens"
                    return Kv(blocks * size, None, source)
    except (ValueError, KeyError):
        return None
    return None


def llamacpp_kv(props: dict[str, Any]) -> tuple[Kv, int] | None:
    """llama.cpp's /props: each of `total_slots` slots has `n_ctx` tokens of KV of its own
    (with --kv-unified the slots share one n_ctx instead: give --kv-tokens there)."""
    try:
        n_ctx = int(props["default_generation_settings"]["n_ctx"])
        slots = int(props["total_slots"])
    except (KeyError, TypeError, ValueError):
        return None
    return Kv(n_ctx * slots, None, f"llama.cpp /props: {slots} slots x {n_ctx} n_ctx"), slots


async def engine_kv(session: aiohttp.ClientSession, base: str) -> tuple[Kv | None, int | None]:
    """The KV capacity the engine reports, and its slots where it says."""
    status, body = await _get(session, f"{base}/metrics")
    if status == 200 and (kv := vllm_kv(body.decode(errors="replace"))) is not None:
        return kv, None
    status, body = await _get(session, f"{base}/props")
    try:
        found = llamacpp_kv(json.loads(body)) if status == 200 else None
    except ValueError:
        found = None
    return (found[0], found[1]) if found else (None, None)


@dataclass
class Answer:
    ttft_s: float
    prompt_tokens: int
    output_tokens: int


async def one_request(
    session: aiohttp.ClientSession, base: str, model: str, w: Workload, seed: str
) -> Answer:
    """One streaming chat request; TTFT at its first content chunk, as vLLM's benchmarks."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt_text(w.prompt_tokens, seed)}],
        "max_tokens": w.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # every answer as long: the workload stays the same at every level
    }
    start = time.monotonic()
    first: float | None = None
    chunks, usage = 0, None
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                text = (await r.read())[:300].decode(errors="replace")
                raise MeasureError(f"POST /v1/chat/completions answered {r.status}: {text}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise MeasureError(f"the server ended a stream with {chunk['error']}")
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    first = time.monotonic() - start if first is None else first
                    chunks += 1
                usage = chunk.get("usage") or usage
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise MeasureError(f"a request to {base} failed: {exc or type(exc).__name__}") from None
    except ValueError:
        raise MeasureError(f"{base} streamed something other than JSON chunks") from None
    if first is None:
        raise MeasureError(f"{base} streamed no tokens for model {model!r}")
    if usage is None:  # no usage in streams: the chunks are the output, the prompt as sent
        return Answer(first, w.prompt_tokens, chunks)
    return Answer(first, int(usage["prompt_tokens"]), int(usage["completion_tokens"]))


async def run_level(
    session: aiohttp.ClientSession, base: str, model: str, w: Workload, streams: int
) -> Level:
    level = Level(streams)
    for _ in range(w.rounds):
        run = secrets.token_hex(4)  # no prompt repeats: a prefix-cache hit would flatter
        answers: list[Answer] = []

        async def stream(s: int, answers: list[Answer] = answers, run: str = run) -> None:
            for i in range(w.requests):
                answers.append(await one_request(session, base, model, w, f"{run}-{s}-{i}"))

        start = time.monotonic()
        await asyncio.gather(*(stream(s) for s in range(streams)))
        seconds = time.monotonic() - start
        tokens = sum(
            w.input_weight * a.prompt_tokens + w.output_weight * a.output_tokens for a in answers
        )
        level.tokens_per_s.append(tokens / seconds)
        level.ttft_s += [a.ttft_s for a in answers]
        level.prompt_tokens += [a.prompt_tokens for a in answers]
        level.output_tokens += [a.output_tokens for a in answers]
    return level


async def measure(
    base: str,
    model: str | None,
    slo_ms: float,
    w: Workload,
    levels: list[int] | None = None,
    most: int = 64,
    kv: Kv | None = None,
    percentile: float = 99.0,
    api_key: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> Capacity:
    base = base.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=w.timeout_s, sock_connect=10)
    # A connection per request: llama.cpp's server closes idle keep-alive ones without notice
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as s:
        names = await served_models(s, base)
        if model is None:
            if len(set(names)) > 1:
                raise MeasureError(f"{base} serves several models: give --model ({names})")
            model = names[0]
        elif model not in names:
            raise MeasureError(f"{base} does not serve model {model!r}; it serves {names}")
        reported, slots = await engine_kv(s, base)
        kv = kv or reported
        if kv is None:  # before the sweep: minutes of measuring would end in this anyway
            raise MeasureError(
                f"{base} reports no KV capacity (vLLM's vllm:cache_config_info, llama.cpp's "
                "/props): give --kv-tokens or --kv-cache-gib"
            )
        await one_request(s, base, model, w, f"warm-{secrets.token_hex(4)}")  # loads, compiles
        planned = levels or default_levels(most, slots)
        done: list[Level] = []
        for streams in planned:
            level = await run_level(s, base, model, w, streams)
            done.append(level)
            ttft = level.ttft_ms(percentile)
            progress(
                f"{streams} streams: {level.median:.0f} tokens/s "
                f"({min(level.tokens_per_s):.0f}-{max(level.tokens_per_s):.0f}), "
                f"TTFT p{percentile:g} {ttft:.0f} ms"
            )
            if ttft > slo_ms:
                break
    met = [lv for lv in done if lv.ttft_ms(percentile) <= slo_ms]
    if not met:
        raise MeasureError(
            f"{done[0].streams} stream(s) already miss the SLO: TTFT p{percentile:g} "
            f"{done[0].ttft_ms(percentile):.0f} ms > {slo_ms:g} ms (a longer SLO, shorter "
            "prompts, or a faster replica)"
        )
    return Capacity(base, model, slo_ms, percentile, w, kv, slots, done, met[-1], planned)
