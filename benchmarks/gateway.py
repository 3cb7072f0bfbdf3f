"""Gateway overhead and throughput, measured in one run.

An emulator with no step delay (`--speed 0`) and a gateway run as separate processes on
loopback; this process is the client. For each mode (non-streaming, streaming) and target
(straight to the emulator, through the gateway) it sends 200 req/s open loop for a few seconds
and records each request's end-to-end latency; the difference between the targets is what the
gateway adds. Then `max_rps`: closed loop with 64 concurrent non-streaming requests through the
gateway. The machine has 2 cores shared by all three processes: read ratios, not absolutes.

    python benchmarks/gateway.py --json out/gateway.json [--seconds 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tokenpools.model.keys import hash_key
from tokenpools.processes import free_port, spawn, stop, wait_ready

KEY = "sk-bench"
MODEL = "bench"


def body(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello " * 20}],
        "max_tokens": 8,
        "stream": stream,
    }


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> float:
    start = time.perf_counter()
    async with session.post(
        f"{url}/v1/chat/completions", json=body(stream), headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - start


async def fixed_rate(url: str, stream: bool, rps: float, seconds: float) -> list[float]:
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        t0 = time.perf_counter()
        for i in range(int(rps * seconds)):
            await asyncio.sleep(max(0.0, t0 + i / rps - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, url, stream)))
        latencies = list(await asyncio.gather(*tasks))
    return latencies


async def closed_loop(url: str, concurrency: int, seconds: float) -> float:
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await one(session, url, False)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def bench_config(backend: str, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """One pool too large to ever refuse, one key: what is measured is the gateway itself."""
    return {
        "state": state or {},
        "pools": [
            {
                "name": "bench",
                "model": "Llama-3.1-8B",
                "servedModels": [MODEL],
                "backends": [{"url": backend}],
                "perReplica": {"tokensPerSecond": 1e9, "kvTokens": 1e9, "concurrency": 1e6},
            }
        ],
        "entitlements": [
            {"name": "bench", "tenantId": "bench", "pool": "bench", "serviceClass": "elastic",
             "concurrency": 1e5, "apiKeys": [hash_key(KEY)]}
        ],
    }  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    emu_port, gw_port = free_port(), free_port()
    emu_url, gw_url = f"http://127.0.0.1:{emu_port}", f"http://127.0.0.1:{gw_port}"
    config = bench_config(emu_url)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    emulator = spawn(
        ["emulate", "--profile", "h100-llama3.1-8b", "--speed", "0", "--port", str(emu_port)]
    )
    gateway = spawn(["serve", "--config", f.name, "--port", str(gw_port)])
    try:
        await wait_ready(f"{emu_url}/health", emulator)
        await wait_ready(f"{gw_url}/readyz", gateway)
        rows = []
        for stream in (False, True):
            mode = "streaming" if stream else "non-streaming"
            for target, url in (("direct", emu_url), ("gateway", gw_url)):
                runs = [
                    await fixed_rate(url, stream, 200, args.seconds) for _ in range(args.repeats)
                ]
                rows.append(
                    {
                        "mode": mode,
                        "target": target,
                        "rps": 200,
                        "p50_ms": statistics.median(pct(r, 50) for r in runs) * 1000,
                        "p99_ms": statistics.median(pct(r, 99) for r in runs) * 1000,
                        "p99_ms_max": max(pct(r, 99) for r in runs) * 1000,
                        "requests": sum(len(r) for r in runs),
                    }
                )
                print(
                    f"{mode:13s} {target:7s}: p50 {rows[-1]['p50_ms']:.2f} ms, "
                    f"p99 {rows[-1]['p99_ms']:.2f} ms",
                    file=sys.stderr,
                )
        maxes = [await closed_loop(gw_url, 64, args.seconds) for _ in range(args.repeats)]
        direct = [await closed_loop(emu_url, 64, args.seconds) for _ in range(args.repeats)]
        print(
            f"max non-streaming req/s through the gateway: {statistics.median(maxes):.0f} "
            f"(runs {', '.join(f'{m:.0f}' for m in maxes)}); straight to the emulator: "
            f"{statistics.median(direct):.0f}",
            file=sys.stderr,
        )
        return {
            "rows": rows,
            "max_rps": statistics.median(maxes),
            "max_rps_runs": maxes,
            "direct_max_rps": statistics.median(direct),
        }
    finally:
        stop(emulator, gateway)
        Path(f.name).unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
