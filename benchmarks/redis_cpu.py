"""Where the shared store's CPU goes, per call and per request, on a redis-server on loopback.

1. Client CPU per script call (an EVALSHA with 45 arguments, 50 calls in flight): redis-py's
   asyncio client (a pooled connection per call, hiredis packing) against the multiplexed
   connection the gateway uses (state/redis/mux.py).
2. Per arrival through the gateway's awaited path (StoreDriver, RedisHotPath, 48
   arrivals in flight, 100 entitlements of every class, admitted ones settled): CPU seconds of
   the redis-server process and of this process, per arrival. Each repeat uses a fresh pool.

    python benchmarks/redis_cpu.py --json out/redis_cpu.json [--repeats 3]
    python benchmarks/redis_cpu.py --json /tmp/redis_cpu.json --smoke    # the test suite's run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio

from redis_store import core_config
from smoke import parse_args
from tokenpools import core_build
from tokenpools.admission.driver import StoreDriver
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.model.config import parse_config
from tokenpools.model.request import RequestCost, Usage
from tokenpools.processes import redis_server
from tokenpools.state.redis.connect import async_client
from tokenpools.state.redis.hot_path import RedisHotPath
from tokenpools.state.redis.store import RedisStore

SCRIPT = "redis.call('HSET', KEYS[1], 'x', ARGV[1]) return {ARGV[1], ARGV[2]}"
ARGS = [repr(1000.123456789 + i) for i in range(45)]
# The JSON (paths as in benchmarks/smoke.py): the medians, and every run.
FIELDS = (
    "client_cpu_per_call_redis_py_us", "client_cpu_per_call_multiplexed_us",
    "redis_cpu_per_arrival_us", "client_cpu_per_arrival_us", "core",
    "runs.redis_py_us", "runs.multiplexed_us", "runs.arrival.[].redis_cpu_us",
    "runs.arrival.[].client_cpu_us", "runs.arrival.[].arrivals_per_s",
    "runs.arrival.[].admitted",
)  # fmt: skip
SMOKE = {"repeats": 1, "calls": 500, "arrivals": 300}


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def client_cpu_us(call: Callable[[], Awaitable[Any]], n: int) -> float:
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < n:
            sent += 1
            await call()

    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(50)))
    return (time.process_time() - start) / n * 1e6


async def redis_py(url: str, calls: int) -> float:
    client = redis.asyncio.Redis(
        connection_pool=redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=32)
    )
    script = client.register_script(SCRIPT)
    await script(keys=["k"], args=ARGS)
    cpu = await client_cpu_us(lambda: script(keys=["k"], args=ARGS), calls)
    await client.aclose()
    return cpu


async def multiplexed(url: str, calls: int) -> float:
    client = async_client(url, 1.0)
    script = client.register_script(SCRIPT)
    await script(keys=["k"], args=ARGS)
    cpu = await client_cpu_us(lambda: script(keys=["k"], args=ARGS), calls)
    await client.aclose()
    return cpu


async def arrivals(core: DecisionCore, n: int, seed: int) -> int:
    """`n` arrivals, 48 in flight, the admitted ones settled; returns how many were admitted."""
    assert isinstance(core.store, RedisStore)
    ledger = StoreDriver(core, RedisHotPath(core.store))
    await ledger.start()
    names, rng, sent, t = list(core.entitlements), random.Random(seed), 0, 1000.0
    admitted = 0

    async def worker() -> None:
        nonlocal sent, t, admitted
        while sent < n:
            sent += 1
            t += 0.0005
            cost = RequestCost(rng.randint(50, 800), rng.randint(16, 256))
            decision = await ledger.admit([rng.choice(names)], cost, t)  # one layer
            if isinstance(decision, Admit):  # settled as StoreDriver.end does, awaited here
                admitted += 1
                ending = core.prepare_end(decision.lease, Usage(cost.input_tokens, 32))
                assert ledger.shared is not None and ending.charged is not None
                await ledger.shared.settle(ending.lease, ending.charged, t, ending.charge)
                core.ended(ending, t)

    await asyncio.gather(*(worker() for _ in range(48)))
    await ledger.aclose()
    return admitted


def per_arrival(url: str, redis_pid: int, run: int, n: int) -> dict[str, float]:
    config = parse_config(core_config())
    core = DecisionCore(config, RedisStore(url, timeout_s=2.0, prefix=f"cpu{run}"), now=1000.0)
    asyncio.run(arrivals(core, min(500, n), run))  # configured and warm
    redis0, self0, wall0 = process_cpu_s(redis_pid), time.process_time(), time.perf_counter()
    admitted = asyncio.run(arrivals(core, n, run + 1))
    if not admitted:  # refusals alone would measure a path that never reaches Redis's script
        raise RuntimeError(f"none of {n} arrivals was admitted")
    return {
        "redis_cpu_us": (process_cpu_s(redis_pid) - redis0) / n * 1e6,
        "client_cpu_us": (time.process_time() - self0) / n * 1e6,
        "arrivals_per_s": n / (time.perf_counter() - wall0),
        "admitted": admitted / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20000, help="script calls per client run")
    parser.add_argument("--arrivals", type=int, default=6000, help="per run of part 2")
    args = parse_args(parser, SMOKE)
    runs: dict[str, list[Any]] = {"redis_py_us": [], "multiplexed_us": [], "arrival": []}
    with redis_server() as (url, proc):
        for run in range(args.repeats):  # alternated, so drift touches both alike
            runs["redis_py_us"].append(asyncio.run(redis_py(url, args.calls)))
            runs["multiplexed_us"].append(asyncio.run(multiplexed(url, args.calls)))
            runs["arrival"].append(per_arrival(url, proc.pid, run, args.arrivals))
            print(
                f"run {run}: client CPU per call redis-py {runs['redis_py_us'][-1]:.0f} us, "
                f"multiplexed {runs['multiplexed_us'][-1]:.0f} us; "
                f"per arrival {runs['arrival'][-1]}",
                file=sys.stderr,
            )

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    result = {
        "client_cpu_per_call_redis_py_us": statistics.median(runs["redis_py_us"]),
        "client_cpu_per_call_multiplexed_us": statistics.median(runs["multiplexed_us"]),
        "redis_cpu_per_arrival_us": med(runs["arrival"], "redis_cpu_us"),
        "client_cpu_per_arrival_us": med(runs["arrival"], "client_cpu_us"),
        "core": core_build(),
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
