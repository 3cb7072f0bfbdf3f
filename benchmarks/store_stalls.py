"""How late Redis answers the gateway, and what a stall costs: the measurements behind the
default `timeoutMs` (docs/redis.md).

1. Call latency on the gateway's awaited path (GatewayLedger over the multiplexed connection, 64
   closed-loop clients admitting and settling, timeout 10 s so nothing times out), with the
   machine idle and with a busy process on every core; the event loop's lag (a 10 ms ticker's
   lateness) beside it. Runs alternate, so drift touches both alike.
2. The pause scenario (tests/test_store_faults.py): 24 clients, Redis stopped and continued
   (SIGSTOP/SIGCONT, 200 ms each) for 4 s, at several `timeoutMs`: requests refused
   `store_unavailable`, guaranteed requests refused, the slowest admission, and what was still
   booked two update periods after the clients finished.

    python benchmarks/store_stalls.py --json out/store_stalls.json [--repeats 3]
    python benchmarks/store_stalls.py --json /tmp/store_stalls.json --smoke  # the tests' run

`--smoke`: 0.5 s of call latency per condition, 2 pauses per scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' fault load

from tests.fault_load import (
    ENTS,
    GOLD_BASELINE,
    Fault,
    Topology,
    drive,
    fault_config,
    paused,
    reader,
)
from tests.faults import fault_proxy, sigcont, sigstop

from smoke import parse_args
from tokenpools.control.decisions import Admit
from tokenpools.gateway.runtime import Gateway
from tokenpools.model.request import RequestCost, Usage
from tokenpools.processes import redis_server

TIMEOUTS_MS = (50, 100, 250, 500)
# The JSON (paths as in benchmarks/smoke.py): medians per condition and per timeoutMs, and
# every run.
FIELDS = (
    "latency.idle.p50_ms", "latency.idle.p99_ms", "latency.idle.p999_ms", "latency.idle.max_ms",
    "latency.idle.loop_lag_p99_ms", "latency.idle.loop_lag_max_ms",
    "latency.contended.p50_ms", "latency.contended.p99_ms", "latency.contended.p999_ms",
    "latency.contended.max_ms", "latency.contended.loop_lag_p99_ms",
    "latency.contended.loop_lag_max_ms",
    "latency_runs.idle.[].calls", "latency_runs.idle.[].over_ms",
    "latency_runs.contended.[].calls", "latency_runs.contended.[].over_ms",
    "pauses.*.store_unavailable", "pauses.*.gold_refused", "pauses.*.slowest_admission_ms",
    "pauses.*.settled_in_s",
    "pause_runs.[].timeout_ms", "pause_runs.[].requests", "pause_runs.[].store_unavailable",
    "pause_runs.[].gold_refused", "pause_runs.[].slowest_admission_ms",
    "pause_runs.[].settled_in_s", "pause_runs.[].left_booked", "pause_runs.[].negative",
)  # fmt: skip
SMOKE = {"repeats": 1, "latency_seconds": 0.5, "pauses": 2}


@contextlib.contextmanager
def busy_cores(on: bool) -> Iterator[None]:
    procs = []
    if on:
        procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)
        ]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def call_latency(url: str, seconds: float = 5.0, clients: int = 64) -> dict[str, Any]:
    config = fault_config(url, f"lat{secrets.token_hex(3)}", timeout_ms=10000)
    gw = Gateway(config, access_log=False)
    await gw.start(0.25, 60.0)
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    lags: list[float] = []
    end = time.monotonic() + seconds

    async def ticker() -> None:
        while time.monotonic() < end:
            due = loop.time() + 0.01
            await asyncio.sleep(0.01)
            lags.append(loop.time() - due)

    async def client(i: int) -> None:
        ent = ENTS[i % 4]
        while time.monotonic() < end:
            start = time.perf_counter()
            decision = await gw.admit(ent, RequestCost(20, 20))
            latencies.append(time.perf_counter() - start)
            if isinstance(decision, Admit):
                gw.admission.track(decision, None).end(Usage(20, 10))
            else:
                await asyncio.sleep(0.005)

    await asyncio.gather(ticker(), *(client(i) for i in range(clients)))
    await gw.stop()
    ms = [x * 1000 for x in latencies]
    return {
        "calls": len(ms),
        "p50_ms": pct(ms, 0.5),
        "p99_ms": pct(ms, 0.99),
        "p999_ms": pct(ms, 0.999),
        "max_ms": max(ms),
        "over_ms": {t: sum(x > t for x in ms) for t in TIMEOUTS_MS},
        "loop_lag_p99_ms": pct([x * 1000 for x in lags], 0.99),
        "loop_lag_max_ms": max(lags) * 1000,
    }


def pause_scenario(
    url: str, proc: subprocess.Popen[bytes], timeout_ms: int, pauses: int = 10
) -> dict[str, Any]:
    """24 clients; Redis stopped 200 ms every 400 ms, `pauses` times, the load 0.2 s longer."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with fault_proxy(port) as proxy:
        client = redis.Redis.from_url(url, socket_timeout=0.5)
        stop = paused(lambda: sigstop(proc), lambda: sigcont(proc))
        topology = Topology(proxy.url, reader(client), {"sigstop": stop})
        prefix = f"ps{secrets.token_hex(3)}"
        config = fault_config(proxy.url, prefix, fallback=1.0, timeout_ms=timeout_ms)
        faults = [Fault(0.4 * i, "sigstop", 0.2) for i in range(pauses)]
        who = lambda i: "gold" if i < GOLD_BASELINE else ENTS[1 + i % 3]  # noqa: E731
        load_s = 0.4 * pauses + 0.2
        run = asyncio.run(drive(config, topology, faults, clients=24, load_s=load_s, who=who))
        client.close()
    waits = [a.decided - a.sent for a in run.answers]
    return {
        "timeout_ms": timeout_ms,
        "requests": len(run.answers),
        "store_unavailable": sum(a.reason == "store_unavailable" for a in run.answers),
        "gold_refused": sum(a.reason is not None for a in run.answers if a.entitlement == "gold"),
        "slowest_admission_ms": max(waits) * 1000,
        "settled_in_s": run.settled_in_s,
        "left_booked": run.left,
        "negative": run.negative,
    }


PAUSE_KEYS = ("store_unavailable", "gold_refused", "slowest_admission_ms", "settled_in_s")


def pause_medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in PAUSE_KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=5.0, help="per condition")
    parser.add_argument("--pauses", type=int, default=10, help="of Redis, per pause scenario")
    args = parse_args(parser, SMOKE)
    latency: dict[str, list[dict[str, Any]]] = {"idle": [], "contended": []}
    pauses: list[dict[str, Any]] = []
    with redis_server() as (url, proc):
        for run in range(args.repeats):
            for condition in latency:
                with busy_cores(condition == "contended"):
                    latency[condition].append(asyncio.run(call_latency(url, args.latency_seconds)))
                print(f"run {run} {condition}: {latency[condition][-1]}", file=sys.stderr)
            for timeout_ms in TIMEOUTS_MS:
                pauses.append(pause_scenario(url, proc, timeout_ms, args.pauses))
                print(f"run {run} pauses: {pauses[-1]}", file=sys.stderr)

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    keys = ("p50_ms", "p99_ms", "p999_ms", "max_ms", "loop_lag_p99_ms", "loop_lag_max_ms")
    result = {
        "latency": {c: {k: med(rows, k) for k in keys} for c, rows in latency.items()},
        "latency_runs": latency,
        "pauses": {
            t: pause_medians([p for p in pauses if p["timeout_ms"] == t]) for t in TIMEOUTS_MS
        },
        "pause_runs": pauses,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print("call latency (ms, medians of runs):")
    for condition, row in result["latency"].items():
        print(f"  {condition:9}", "  ".join(f"{k} {v:.2f}" for k, v in row.items()))
    print("pause scenario (medians of runs):")
    for t, row in result["pauses"].items():
        print(f"  timeoutMs {t:4}", "  ".join(f"{k} {v:.3g}" for k, v in row.items()))


if __name__ == "__main__":
    main()
