"""What the HTTP stack alone costs, next to the gateway: CPU per request of a bare aiohttp server
answering a canned completion, of a bare aiohttp proxy (server and client, nothing else) in
front of the emulator, and of `tokenpools serve` in front of the same emulator.

Each target alone on core 1; the emulator and the client (64 closed-loop connections, 4 s per
run) on core 0; targets interleaved, 3 runs each. CPU is the target process's user+system time
over the requests it served (/proc).

    python benchmarks/http_floor.py --json out/http_floor.json
    python benchmarks/http_floor.py --json /tmp/http_floor.json --smoke    # the test suite's run
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
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent.parent))
from benchmarks.gateway import bench_config, closed_loop, cpu_seconds
from benchmarks.smoke import parse_args

from tokenpools.processes import free_port, wait_ready

CANNED = json.dumps(
    {"id": "x", "object": "chat.completion", "usage": {"prompt_tokens": 30, "completion_tokens": 8},
     "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok " * 8},
                  "finish_reason": "length"}]}
).encode()  # fmt: skip
# The JSON (paths as in benchmarks/smoke.py): per target, each run's req/s and CPU per request.
FIELDS = (
    "bare-canned.req_s", "bare-canned.cpu_ms_per_req", "bare-canned.cpu_ms_per_req_median",
    "bare-proxy.req_s", "bare-proxy.cpu_ms_per_req", "bare-proxy.cpu_ms_per_req_median",
    "gateway.req_s", "gateway.cpu_ms_per_req", "gateway.cpu_ms_per_req_median",
)  # fmt: skip
SMOKE = {"seconds": 0.25, "repeats": 1}


def bare(mode: str, port: int, upstream: str) -> None:
    """The bare server (`canned`) or proxy (`proxy`), run in a child process."""
    import aiohttp
    import uvloop
    from aiohttp import web

    async def canned(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=CANNED, content_type="application/json")

    async def proxy(request: web.Request) -> web.Response:
        raw = await request.read()
        async with request.app[SESSION].post(
            upstream + "/v1/chat/completions",
            data=raw,
            headers={"Content-Type": "application/json"},
        ) as r:
            body = await r.read()
        return web.Response(body=body, content_type="application/json")

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    SESSION = web.AppKey("session", aiohttp.ClientSession)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", canned if mode == "canned" else proxy)
    app.router.add_get("/readyz", ready)

    async def session(app: web.Application) -> Any:
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session)
    web.run_app(app, port=port, loop=uvloop.new_event_loop(), access_log=None, print=None)


def pinned(command: list[str], cpu: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["taskset", "-c", cpu, *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    os.sched_setaffinity(0, {0})
    emu_port = free_port()
    emu_url = f"http://127.0.0.1:{emu_port}"
    python = sys.executable
    emulator = pinned(
        [python, "-m", "tokenpools.cli", "emulate", "--profile", "h100-llama3.1-8b",
         "--speed", "0", "--port", str(emu_port)], "0",
    )  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(bench_config(emu_url), f)
    targets: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    try:
        await wait_ready(f"{emu_url}/health", emulator)
        for name in ("bare-canned", "bare-proxy", "gateway"):
            port = free_port()
            if name == "gateway":
                command = [python, "-m", "tokenpools.cli", "serve", "--config", f.name]
                command += ["--port", str(port)]
            else:
                command = [python, __file__, "--bare", name.removeprefix("bare-"), str(port)]
                command += [emu_url]
            proc = pinned(command, "1")
            targets[name] = (f"http://127.0.0.1:{port}", proc)
            await wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        for _ in range(args.repeats):
            for name, (url, proc) in targets.items():
                before = cpu_seconds(proc.pid)
                rps = await closed_loop(url, 64, args.seconds)
                cpu_ms = (cpu_seconds(proc.pid) - before) / (rps * args.seconds) * 1000
                runs[name].append((rps, cpu_ms))
        out = {}
        for name, got in runs.items():
            out[name] = {
                "req_s": [round(r) for r, _ in got],
                "cpu_ms_per_req": [round(c, 3) for _, c in got],
                "cpu_ms_per_req_median": round(statistics.median(c for _, c in got), 3),
            }
            print(f"{name:12s} CPU {out[name]['cpu_ms_per_req']} ms/request", file=sys.stderr)
        return out
    finally:
        for _, proc in targets.values():
            proc.terminate()
        emulator.terminate()
        Path(f.name).unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bare", nargs=3, metavar=("MODE", "PORT", "UPSTREAM"))
    args = parse_args(parser, SMOKE)
    if args.bare:
        bare(args.bare[0], int(args.bare[1]), args.bare[2])
        return
    if args.json is None:
        parser.error("--json is required")
    result = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
