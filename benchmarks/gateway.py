"""Gateway overhead and throughput, measured in one run, optionally against an older commit.

An emulator with no step delay (`--speed 0`) and the gateway run as separate processes on
loopback; this process is the client. For each mode (non-streaming, streaming) and target
(straight to the emulator; through this checkout's gateway, with and without its access log;
through a baseline checkout's, if given; through this checkout's gateway while a dashboard
page polls its /admin/history every 2 s) it sends 200 req/s open loop for a few seconds and
records each request's end-to-end latency, and the CPU the gateway process spent; the
difference to `direct` is what a gateway adds. Then `max_rps`: closed loop with 64 concurrent
non-streaming requests per target. Repeats interleave the targets. Both gateways run from
source with the same interpreter (pure Python core); this one's access log goes to /dev/null.
`--pin` puts the gateways on core 1 and the emulator and client on core 0.

    git worktree add /tmp/baseline 0bdc6db
    python benchmarks/gateway.py --json out/gateway.json --baseline-src /tmp/baseline --pin
    python benchmarks/gateway.py --json /tmp/gateway.json --smoke    # the test suite's run

`--smoke` also measures this checkout as its own baseline, so that path runs too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from smoke import parse_args
from tokenpools.model.keys import hash_key
from tokenpools.processes import free_port, stop, wait_ready

ROOT = Path(__file__).parent.parent
KEY = "sk-bench"
ADMIN_KEY = "sk-bench-admin"
MODEL = "bench"
DASHBOARD = "gateway-dashboard-open"  # the same gateway process as `gateway`, with a page polling
# The JSON (paths as in benchmarks/smoke.py): a row per mode and target; per target the closed
# loop's runs (req/s), their median and the gateway's CPU per request (none for `direct`).
FIELDS = (
    "rows.[].mode", "rows.[].target", "rows.[].rps", "rows.[].p50_ms", "rows.[].p99_ms",
    "rows.[].p99_ms_runs", "rows.[].cpu_ms_per_req", "rows.[].requests",
    "max_rps.*.runs", "max_rps.*.cpu_ms_per_req", "max_rps.*.max_rps",
    "max_rps.direct", "max_rps.gateway", "max_rps.gateway-no-access-log",
    "max_rps.gateway-dashboard-open",
    "pinned",
)  # fmt: skip
SMOKE = {"seconds": 0.25, "repeats": 1, "rate": 40.0, "baseline_src": ROOT}


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


async def closed_loop(url: str, concurrency: int, seconds: float, stream: bool = False) -> float:
    """`concurrency` clients, each sending its next request when its last is answered: req/s."""
    done, took = await answered(url, concurrency, seconds, stream)
    return done / took


async def answered(
    url: str, concurrency: int, seconds: float, stream: bool = False
) -> tuple[int, float]:
    """The closed loop's requests answered, and the seconds they took."""
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await one(session, url, stream)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def bench_config(backend: str, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """One pool too large to ever refuse, one key: what is measured is the gateway itself."""
    return {
        "state": state or {},
        "gateway": {"adminKeys": [hash_key(ADMIN_KEY)]},
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


async def with_page_open(url: str, work: Any) -> Any:
    """`work`, while a dashboard page polls `url`'s /admin/history as the page does."""

    async def poll() -> None:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(f"{url}/admin/history", headers=headers) as r:
                    assert r.status == 200, r.status
                    await r.read()
                await asyncio.sleep(2.0)

    poller = asyncio.create_task(poll())
    try:
        return await work
    finally:
        poller.cancel()


def spawn_pinned(args: list[str], src: Path | None, cpus: str | None) -> subprocess.Popen[bytes]:
    """`tokenpools ARGS` from the source tree `src` (None: the installed package), on `cpus`."""
    env = dict(os.environ)
    if src is not None:  # the same interpreter and dependencies, this code
        env["PYTHONPATH"] = str(src / "src")
    command = [sys.executable, "-m", "tokenpools.cli", *args]
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def cpu_seconds(pid: int) -> float:
    """User and system CPU a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measured(proc: subprocess.Popen[bytes] | None, work: Any) -> tuple[Any, float]:
    """Run `work`; also return the CPU seconds `proc` spent meanwhile."""
    before = cpu_seconds(proc.pid) if proc else 0.0
    result = await work
    return result, (cpu_seconds(proc.pid) - before) if proc else 0.0


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    emu_port = free_port()
    emu_url = f"http://127.0.0.1:{emu_port}"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(bench_config(emu_url), f)
    pin_gw, pin_rest = ("1", "0") if args.pin else (None, None)
    if args.pin:  # this process (the client) shares core 0 with the emulator
        os.sched_setaffinity(0, {0})
    emulator = spawn_pinned(
        ["emulate", "--profile", "h100-llama3.1-8b", "--speed", "0", "--port", str(emu_port)],
        None,
        pin_rest,
    )
    variants: dict[str, tuple[Path, list[str]]] = {
        "gateway": (ROOT, []),
        "gateway-no-access-log": (ROOT, ["--no-access-log"]),
    }
    if args.baseline_src is not None:
        variants["baseline"] = (args.baseline_src, [])
    gateways: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    try:
        await wait_ready(f"{emu_url}/health", emulator)
        for name, (src, options) in variants.items():
            port = free_port()
            serve = ["serve", "--config", f.name, "--port", str(port), *options]
            proc = spawn_pinned(serve, src, pin_gw)
            gateways[name] = (f"http://127.0.0.1:{port}", proc)
            await wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
        targets = {"direct": (emu_url, None), **gateways, DASHBOARD: gateways["gateway"]}
        runs: dict[tuple[str, str], list[tuple[list[float], float]]] = {}
        for _ in range(args.repeats):  # interleaved, so drift in the machine hits every target
            for stream in (False, True):
                mode = "streaming" if stream else "non-streaming"
                for target, (url, proc) in targets.items():
                    work = fixed_rate(url, stream, args.rate, args.seconds)
                    if target == DASHBOARD:
                        work = with_page_open(url, work)
                    runs.setdefault((mode, target), []).append(await measured(proc, work))
        rows = []
        for (mode, target), got in runs.items():
            latencies = [lat for lat, _ in got]
            requests = sum(len(lat) for lat in latencies)
            rows.append(
                {
                    "mode": mode,
                    "target": target,
                    "rps": args.rate,
                    "p50_ms": statistics.median(pct(r, 50) for r in latencies) * 1000,
                    "p99_ms": statistics.median(pct(r, 99) for r in latencies) * 1000,
                    "p99_ms_runs": [pct(r, 99) * 1000 for r in latencies],
                    "cpu_ms_per_req": sum(cpu for _, cpu in got) / requests * 1000,
                    "requests": requests,
                }
            )
            print(
                f"{mode:13s} {target:21s}: p50 {rows[-1]['p50_ms']:.2f} ms, p99 "
                f"{rows[-1]['p99_ms']:.2f} ms, CPU {rows[-1]['cpu_ms_per_req']:.3f} ms/req",
                file=sys.stderr,
            )
        ceilings: dict[str, Any] = {}
        for _ in range(args.repeats):
            for target, (url, proc) in targets.items():
                work = closed_loop(url, 64, args.seconds)
                if target == DASHBOARD:
                    work = with_page_open(url, work)
                done, cpu = await measured(proc, work)
                entry = ceilings.setdefault(target, {"runs": [], "cpu_ms_per_req": []})
                entry["runs"].append(done)
                if proc is not None:
                    entry["cpu_ms_per_req"].append(cpu / (done * args.seconds) * 1000)
        for target, entry in ceilings.items():
            entry["max_rps"] = statistics.median(entry["runs"])
            print(
                f"max non-streaming req/s, {target}: {entry['max_rps']:.0f} "
                f"(runs {', '.join(f'{m:.0f}' for m in entry['runs'])})",
                file=sys.stderr,
            )
        return {"rows": rows, "max_rps": ceilings, "pinned": args.pin}
    finally:
        stop(emulator, *(proc for _, proc in gateways.values()))
        Path(f.name).unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop requests per second")
    parser.add_argument(
        "--baseline-src", type=Path, help="a checkout of an older commit, measured alongside"
    )
    parser.add_argument("--pin", action="store_true", help="the gateways on core 1, the rest on 0")
    args = parse_args(parser, SMOKE)
    result = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
