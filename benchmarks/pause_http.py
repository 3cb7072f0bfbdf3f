"""The paused-Redis scenario over HTTP, as an operator's bad day looks: one `tokenpools serve`
on Redis (`timeoutMs: 50`, `leaseTtlS` at its default of 600 s) in front of an emulator, 24
closed-loop clients sending short chat requests (gold within its guaranteed baseline, elastic,
spot), and Redis stopped and continued (SIGSTOP/SIGCONT, 200 ms each) for 4 s. Reported: the
answers by tenant and status, and the pool's slots still booked in Redis 1 s and 10 s after the
last client finished.

    python benchmarks/pause_http.py --json out/pause_http.json [--repeats 3] [--base SRC]

`--base SRC` runs the same scenario, alternated, with the gateway from another source tree
(for example a worktree of an older commit's `src`), as a baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

from tokenpools.model.keys import hash_key
from tokenpools.processes import free_port, redis_server, spawn, stop, wait_ready

SLOTS = 64
GOLD_BASELINE = 8
KEYS = {"gold": "sk-gold", "elastic": "sk-elastic", "spot": "sk-spot"}


def config(backend: str, redis_url: str) -> dict[str, Any]:
    ents = [
        {"name": "gold", "serviceClass": "guaranteed", "sloTargetMs": 1000,
         "concurrency": GOLD_BASELINE},
        {"name": "elastic", "serviceClass": "elastic", "sloTargetMs": 2000, "concurrency": 8,
         "burst": {"concurrency": 32}},
        {"name": "spot", "serviceClass": "spot"},
    ]  # fmt: skip
    for e in ents:
        e.update(tenantId=e["name"], pool="p", apiKeys=[hash_key(KEYS[e["name"]])])
    return {
        "state": {"backend": "redis", "url": redis_url, "timeoutMs": 50, "fallbackFraction": 1.0},
        "policy": {"retryAfterMinS": 0.2},
        "pools": [
            {
                "name": "p",
                "model": "Llama-3.1-8B",
                "servedModels": ["m"],
                "backends": [{"url": backend, "timeoutS": 30}],
                "perReplica": {"tokensPerSecond": 1e6, "kvTokens": 1e6, "concurrency": SLOTS},
            }
        ],
        "entitlements": ents,
    }


async def load(url: str, redis_pid: int, clients: int = 24) -> collections.Counter[str]:
    answers: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + 5.0

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        who = "gold" if i < GOLD_BASELINE else ("elastic", "spot")[i % 2]
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {KEYS[who]}"}
        while time.monotonic() < end:
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                data = await r.json()
                code = "" if r.status == 200 else f" {data['error'].get('code')}"
                answers[f"{who} {r.status}{code}"] += 1
                if r.status != 200:
                    await asyncio.sleep(min(float(r.headers.get("retry-after-ms", 200)), 500) / 1e3)

    async def pauses() -> None:
        await asyncio.sleep(0.5)
        for _ in range(10):
            os.kill(redis_pid, signal.SIGSTOP)
            await asyncio.sleep(0.2)
            os.kill(redis_pid, signal.SIGCONT)
            await asyncio.sleep(0.2)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(pauses(), *(client(i, session) for i in range(clients)))
    return answers


def booked(r: redis.Redis) -> float:
    value = r.hget("tokenpools:{p}", "conc")
    return float(value) if value is not None else 0.0


def scenario(src: str | None) -> dict[str, Any]:
    with redis_server() as (redis_url, redis_proc), tempfile.TemporaryDirectory() as work:
        emu_port, port = free_port(), free_port()
        backend = f"http://127.0.0.1:{emu_port}"
        path = Path(work) / "gateway.yaml"
        path.write_text(yaml.safe_dump(config(backend, redis_url)))
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = src
        emulator = spawn(["emulate", "--profile", "h100-llama3.1-8b", "--port", str(emu_port)])
        gateway = subprocess.Popen(
            [sys.executable, "-m", "tokenpools.cli", "serve", "--config", str(path),
             "--port", str(port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            asyncio.run(wait_ready(f"{backend}/health", emulator))
            asyncio.run(wait_ready(f"http://127.0.0.1:{port}/readyz", gateway))
            answers = asyncio.run(load(f"http://127.0.0.1:{port}", redis_proc.pid))
            r = redis.Redis.from_url(redis_url)
            time.sleep(1.0)  # a measurement point, not a synchronisation
            after_1s = booked(r)
            time.sleep(9.0)
            after_10s = booked(r)
        finally:
            stop(emulator, gateway)
    return {"answers": dict(answers), "booked_after_1s": after_1s, "booked_after_10s": after_10s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", help="the gateway's source tree for the baseline runs")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"this": [], **({"base": []} if args.base else {})}
    for run in range(args.repeats):
        for name in runs:
            runs[name].append(scenario(args.base if name == "base" else None))
            print(f"run {run} {name}: {runs[name][-1]}", file=sys.stderr)
    result = {
        name: {
            "booked_after_10s_median": statistics.median(r["booked_after_10s"] for r in rows),
            "booked_after_10s": [r["booked_after_10s"] for r in rows],
            "gold_refused": [
                sum(n for k, n in r["answers"].items() if k.startswith("gold") and " 200" not in k)
                for r in rows
            ],
            "runs": rows,
        }
        for name, rows in runs.items()
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    for name, row in result.items():
        print(f"{name}: slots booked 10 s after {row['booked_after_10s']}, "
              f"gold refused {row['gold_refused']}")  # fmt: skip


if __name__ == "__main__":
    main()
