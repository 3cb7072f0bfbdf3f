"""The paused-Redis scenario over HTTP, as an operator's bad day looks: one `tokenpools serve`
on Redis (`timeoutMs: 50`, `leaseTtlS` at its default of 600 s) in front of an emulator, 24
closed-loop clients sending short chat requests (gold within its guaranteed baseline, elastic,
spot), and Redis stopped and continued (SIGSTOP/SIGCONT, 200 ms each) for 4 s. Reported: the
answers by tenant and status, and the pool's slots still booked in Redis 1 s and 10 s after the
last client finished.

    python benchmarks/pause_http.py --json out/pause_http.json [--repeats 3] [--base SRC]

`--base SRC` runs the same scenario, alternated, with the gateway from another source tree
(for example a worktree of an older commit's `src`), as a baseline measured in the same run.

    python benchmarks/pause_http.py --json /tmp/pause_http.json --smoke    # the test suite's run

`--smoke`: 1.3 s of load with 2 pauses, both counts 1 s after the last client (the JSON's
`booked_after_10s` is then the second), and this checkout's `src` as its own `--base`.
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

from smoke import parse_args
from tokenpools.model.keys import hash_key
from tokenpools.processes import free_port, redis_server, spawn, stop, wait_ready

SLOTS = 64
GOLD_BASELINE = 8
KEYS = {"gold": "sk-gold", "elastic": "sk-elastic", "spot": "sk-spot"}
# The JSON (paths as in benchmarks/smoke.py): per gateway ("this", and "base" with --base), the
# slots still booked, gold's refusals, and every run's answers by tenant and status.
FIELDS = (
    "this.booked_after_10s_median", "this.booked_after_10s", "this.gold_refused",
    "this.runs.[].answers", "this.runs.[].booked_after_1s", "this.runs.[].booked_after_10s",
    "*.booked_after_10s_median", "*.gold_refused", "*.runs.[].answers",
)  # fmt: skip
SMOKE = {
    "repeats": 1,
    "load_seconds": 1.3,
    "pauses": 2,
    "after_seconds": 1.0,
    "base": str(Path(__file__).resolve().parent.parent / "src"),
}


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


async def load(
    url: str, redis_pid: int, seconds: float, pauses: int, clients: int = 24
) -> collections.Counter[str]:
    """`clients` for `seconds`, Redis paused `pauses` times from 0.5 s on."""
    answers: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + seconds

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

    async def pause() -> None:
        await asyncio.sleep(0.5)
        for _ in range(pauses):
            os.kill(redis_pid, signal.SIGSTOP)
            await asyncio.sleep(0.2)
            os.kill(redis_pid, signal.SIGCONT)
            await asyncio.sleep(0.2)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(pause(), *(client(i, session) for i in range(clients)))
    return answers


def booked(r: redis.Redis) -> float:
    value = r.hget("tokenpools:{p}", "conc")
    return float(value) if value is not None else 0.0


def scenario(src: str | None, args: argparse.Namespace) -> dict[str, Any]:
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
            url = f"http://127.0.0.1:{port}"
            answers = asyncio.run(load(url, redis_proc.pid, args.load_seconds, args.pauses))
            r = redis.Redis.from_url(redis_url)
            time.sleep(1.0)  # a measurement point, not a synchronisation
            after_1s = booked(r)
            time.sleep(max(0.0, args.after_seconds - 1.0))
            after_10s = booked(r)
        finally:
            stop(emulator, gateway)
    return {"answers": dict(answers), "booked_after_1s": after_1s, "booked_after_10s": after_10s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", help="the gateway's source tree for the baseline runs")
    parser.add_argument("--load-seconds", type=float, default=5.0, help="of clients")
    parser.add_argument("--pauses", type=int, default=10, help="of Redis, 200 ms each")
    parser.add_argument(
        "--after-seconds", type=float, default=10.0, help="the second count, after the last client"
    )
    args = parse_args(parser, SMOKE)
    runs: dict[str, list[dict[str, Any]]] = {"this": [], **({"base": []} if args.base else {})}
    for run in range(args.repeats):
        for name in runs:
            runs[name].append(scenario(args.base if name == "base" else None, args))
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
