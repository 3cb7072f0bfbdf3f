"""The shared Redis store: admission latency, and gateway throughput with one and three replicas.

1. Admission: `DecisionCore.admit` + `settle` on a RedisStore against a redis-server on
   loopback, 100 entitlements of every class in one pool, a mix that is admitted and rejected.
   Latency per call, several runs; the memory store is measured in the same run as baseline.
   The same arrivals again through the gateway's awaited path (StoreDriver, one call in
   flight on the multiplexed connection).
2. Round trips: script calls Redis served for one admission, one refusal and one settle.
3. Gateway: closed loop, 64 concurrent non-streaming requests, against one gateway process on
   Redis, then three (the client spreads its requests over them), with an emulator (no step
   delay) as backend; one gateway on the memory store is the baseline, measured in turn with
   them in each repeat. The machine has 2 cores shared by every process: read ratios.

    python benchmarks/redis_store.py --json out/redis_store.json [--seconds 5] [--repeats 3]
    python benchmarks/redis_store.py --json /tmp/redis_store.json --smoke    # the tests' run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' Redis topologies

from tests.redis_topologies import redis_cluster

from gateway import bench_config, closed_loop, pct
from smoke import parse_args
from tokenpools import core_build
from tokenpools.admission.driver import StoreDriver
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.control.store import Lease
from tokenpools.model.config import parse_config
from tokenpools.model.request import RequestCost, Usage
from tokenpools.processes import free_port, redis_server, spawn, stop, wait_ready
from tokenpools.state.memory import MemoryStore
from tokenpools.state.redis.hot_path import RedisHotPath
from tokenpools.state.redis.store import RedisStore

CLASSES = ["guaranteed", "dedicated", "elastic", "spot", "preemptible"]
# The JSON (paths as in benchmarks/smoke.py): the medians, the round trips, and every run.
FIELDS = (
    "admission_p50_ms", "admission_p99_ms", "gateway_rps_1_replica", "gateway_rps_3_replicas",
    "settle_p50_ms", "settle_p99_ms", "redis_ping_p50_ms", "redis_ping_p99_ms",
    "memory_admission_p50_ms", "memory_admission_p99_ms", "memory_gateway_rps_1_replica",
    "gateway_rps_memory", "gateway_redis_vs_memory",
    "awaited_admission_p50_ms", "awaited_admission_p99_ms", "awaited_settle_p99_ms",
    "awaited_ping_p50_ms", "awaited_ping_p99_ms",
    "round_trips.admit", "round_trips.refusal", "round_trips.settle",
    "cluster_admission_p50_ms", "cluster_admission_p99_ms", "core",
    "runs.admission.redis.[].admit_p99_ms", "runs.admission.memory.[].admit_p99_ms",
    "runs.admission.ping.[].p99_ms", "runs.awaited_admission.[].settle_p50_ms",
    "runs.cluster_admission.redis.[].admit_p99_ms", "runs.gateway_rps.memory_1",
    "runs.gateway_rps.redis_1", "runs.gateway_rps.redis_3", "runs.redis_vs_memory",
)  # fmt: skip
SMOKE = {"seconds": 0.25, "repeats": 1, "decisions": 300}


def core_config() -> dict[str, Any]:
    ents = []
    for i in range(100):
        cls = CLASSES[i % len(CLASSES)]
        ent: dict[str, Any] = {"name": f"t{i}", "tenantId": f"t{i}", "pool": "p"}
        ent["serviceClass"] = cls
        if cls in ("guaranteed", "dedicated", "elastic"):
            ent.update(sloTargetMs=1000, concurrency=2)
        ents.append(ent)
    pool = {
        "name": "p",
        "model": "Llama-3.1-8B",
        "replicas": 4,
        "perReplica": {"tokensPerSecond": 20000, "kvTokens": 500000, "concurrency": 64},
    }
    return {"pools": [pool], "entitlements": ents}


def admission_run(core: DecisionCore, n: int, seed: int) -> tuple[list[float], list[float]]:
    """n arrivals with a bounded number in flight; returns admit and settle latencies (s)."""
    rng = random.Random(seed)
    names = list(core.entitlements)
    live: list[str] = []
    admit_s, settle_s = [], []
    t = 1000.0 * seed
    for _ in range(n):
        t += 0.002
        cost = RequestCost(rng.randint(50, 800), rng.randint(16, 256))
        start = time.perf_counter()
        decision = core.admit(rng.choice(names), cost, t)
        admit_s.append(time.perf_counter() - start)
        if isinstance(decision, Admit):
            live.append(decision.lease.lease_id)
        if len(live) > 200 or (live and rng.random() < 0.5):
            lease_id = live.pop(rng.randrange(len(live)))
            start = time.perf_counter()
            core.settle(lease_id, Usage(cost.input_tokens, 32), t)
            settle_s.append(time.perf_counter() - start)
        if rng.random() < 0.01:
            core.tick(t)
    for lease_id in live:
        core.release(lease_id, t)
    return admit_s, settle_s


async def awaited_run(core: DecisionCore, n: int, seed: int) -> dict[str, float]:
    """`admission_run`'s arrivals through the gateway's awaited path (StoreDriver on the
    multiplexed connection), one call in flight: admit and settle latencies."""
    assert isinstance(core.store, RedisStore)
    ledger = StoreDriver(core, RedisHotPath(core.store))
    await ledger.start()
    rng = random.Random(seed)
    names = list(core.entitlements)
    live: list[tuple[Lease, RequestCost]] = []
    admit_s, settle_s, ping_s = [], [], []
    t = 1000.0 * seed
    for _ in range(n):
        t += 0.002
        start = time.perf_counter()  # the floor: a bare PING over the same connection
        await ledger.shared.client.call("PING")  # type: ignore[union-attr]
        ping_s.append(time.perf_counter() - start)
        cost = RequestCost(rng.randint(50, 800), rng.randint(16, 256))
        start = time.perf_counter()
        decision = await ledger.admit([rng.choice(names)], cost, t)  # a request of one layer
        admit_s.append(time.perf_counter() - start)
        if isinstance(decision, Admit):
            live.append((decision.lease, cost))
        if len(live) > 200 or (live and rng.random() < 0.5):
            lease, cost = live.pop(rng.randrange(len(live)))
            # settled as StoreDriver.end does, the store's part awaited here to time it
            ending = core.prepare_end(lease, Usage(cost.input_tokens, 32))
            assert ledger.shared is not None and ending.charged is not None
            start = time.perf_counter()
            await ledger.shared.settle(ending.lease, ending.charged, t, ending.charge)
            settle_s.append(time.perf_counter() - start)
            core.ended(ending, t)
        if rng.random() < 0.01:
            await ledger.background(core.tick, t)
    for lease, _ in live:
        await ledger.shared.release(lease, t)  # type: ignore[union-attr]
    await ledger.aclose()
    return {
        "admit_p50_ms": pct(admit_s, 50) * 1000,
        "admit_p99_ms": pct(admit_s, 99) * 1000,
        "settle_p50_ms": pct(settle_s, 50) * 1000,
        "settle_p99_ms": pct(settle_s, 99) * 1000,
        "ping_p50_ms": pct(ping_s, 50) * 1000,
        "ping_p99_ms": pct(ping_s, 99) * 1000,
    }


def awaited_admission(url: str, repeats: int, n: int) -> list[dict[str, float]]:
    config = parse_config(core_config())
    rows = []
    for run in range(repeats):
        store = RedisStore(url, timeout_s=1.0, prefix=f"awaited{run}")
        core = DecisionCore(config, store, now=1000.0 * run)
        rows.append(asyncio.run(awaited_run(core, n, run)))
        print(
            f"awaited admission run {run}: admit p50 {rows[-1]['admit_p50_ms']:.3f} ms "
            f"p99 {rows[-1]['admit_p99_ms']:.3f} ms, settle p50 {rows[-1]['settle_p50_ms']:.3f} ms "
            f"(PING p50 {rows[-1]['ping_p50_ms']:.3f} ms, p99 {rows[-1]['ping_p99_ms']:.3f} ms)",
            file=sys.stderr,
        )
    return rows


def ping_ms(url: str, n: int) -> tuple[float, float]:
    """The floor: p50 and p99 of a bare PING round trip to the same server."""
    client = redis.Redis.from_url(url)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - start)
    client.close()
    return pct(times, 50) * 1000, pct(times, 99) * 1000


def admission(
    url: str, repeats: int, n: int, backends: tuple[str, ...] = ("memory", "redis")
) -> dict[str, Any]:
    config = parse_config(core_config())
    rows: dict[str, list[dict[str, float]]] = {"redis": [], "memory": [], "ping": []}
    p50 = p99 = float("nan")
    for run in range(repeats):
        if "memory" in backends:  # a bare PING, to one server
            p50, p99 = ping_ms(url, n)
            rows["ping"].append({"p50_ms": p50, "p99_ms": p99})
        for backend in backends:
            store = (
                RedisStore(url, timeout_s=1.0, prefix=f"bench{run}")
                if backend == "redis"
                else MemoryStore()
            )
            core = DecisionCore(config, store, now=1000.0 * run)
            admit_s, settle_s = admission_run(core, n, run)
            rows[backend].append(
                {
                    "admit_p50_ms": pct(admit_s, 50) * 1000,
                    "admit_p99_ms": pct(admit_s, 99) * 1000,
                    "settle_p50_ms": pct(settle_s, 50) * 1000,
                    "settle_p99_ms": pct(settle_s, 99) * 1000,
                }
            )
            last = rows[backend][-1]
            print(
                f"admission {backend:6s} run {run}: admit p50 {last['admit_p50_ms']:.3f} ms "
                f"p99 {last['admit_p99_ms']:.3f} ms, settle p50 {last['settle_p50_ms']:.3f} ms "
                f"(PING p50 {p50:.3f} ms, p99 {p99:.3f} ms)",
                file=sys.stderr,
            )
    return rows


async def start_gateways(
    emu_url: str, state: dict[str, Any], replicas: int
) -> tuple[list[str], list[Any], Path]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(bench_config(emu_url, state), f)
    ports = [free_port() for _ in range(replicas)]
    procs = [spawn(["serve", "--config", f.name, "--port", str(p)]) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for url, proc in zip(urls, procs, strict=True):
        await wait_ready(f"{url}/readyz", proc)
    return urls, procs, Path(f.name)


async def gateway(url: str, seconds: float, repeats: int) -> dict[str, list[float]]:
    """Every setup runs at once, idle but for the one measured; the setups take turns in
    each repeat, so drift on this shared machine touches them alike."""
    emu_port = free_port()
    emu_url = f"http://127.0.0.1:{emu_port}"
    emulator = spawn(
        ["emulate", "--profile", "h100-llama3.1-8b", "--speed", "0", "--port", str(emu_port)]
    )
    # Throughput at saturation, not the outage policy: on 2 shared cores a busy event loop can
    # answer a 50 ms read late, which the default timeout would take for an outage.
    redis_state = {"backend": "redis", "url": url, "keyPrefix": "gwbench", "timeoutMs": 500}
    setups = {"memory_1": ({}, 1), "redis_1": (redis_state, 1), "redis_3": (redis_state, 3)}
    started: dict[str, tuple[list[str], list[Any], Path]] = {}
    try:
        await wait_ready(f"{emu_url}/health", emulator)
        for name, (state, replicas) in setups.items():
            started[name] = await start_gateways(emu_url, state, replicas)
        out: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(repeats):
            for name, (urls, _, _) in started.items():
                # 64 clients in all, spread evenly over the replicas
                rates = await asyncio.gather(
                    *(closed_loop(u, 64 // len(urls), seconds) for u in urls)
                )
                out[name].append(sum(rates))
        for name, runs in out.items():
            print(f"gateway {name}: {', '.join(f'{r:.0f}' for r in runs)} req/s", file=sys.stderr)
        return out
    finally:
        for _, procs, path in started.values():
            stop(*procs)
            path.unlink()
        stop(emulator)


def round_trips(url: str) -> dict[str, int]:
    """Script calls Redis served for one admitted request (admit, settle) and one refusal."""
    config = parse_config(
        {
            **core_config(),
            "entitlements": [
                {
                    "name": "gold",
                    "tenantId": "gold",
                    "serviceClass": "guaranteed",
                    "pool": "p",
                    "concurrency": 1,
                }
            ],
        }
    )
    client = redis.Redis.from_url(url)
    core = DecisionCore(config, RedisStore(url, timeout_s=1.0, prefix="trips"), now=1.0)

    def calls() -> int:
        stats = client.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))

    core.tick(1.0)  # configuration and the first update period done before counting
    before = calls()
    first = core.admit("gold", RequestCost(10, 10), 1.0)
    after_admit = calls()
    refused = core.admit("gold", RequestCost(10, 10), 1.0)
    after_refusal = calls()
    assert isinstance(first, Admit) and not isinstance(refused, Admit)
    core.settle(first.lease.lease_id, Usage(10, 10), 1.0)
    after_settle = calls()
    client.close()
    return {
        "admit": after_admit - before,
        "refusal": after_refusal - after_admit,
        "settle": after_settle - after_refusal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decisions", type=int, default=20000)
    args = parse_args(parser, SMOKE)
    with redis_server() as (url, _):
        adm = admission(url, args.repeats, args.decisions)
        awaited = awaited_admission(url, args.repeats, args.decisions)
        trips = round_trips(url)
        gw = asyncio.run(gateway(url, args.seconds, args.repeats))
    with redis_cluster() as cluster:  # three masters with a replica each, on loopback
        clustered = admission(cluster.url, args.repeats, args.decisions, backends=("redis",))
    ratios = [r / m for r, m in zip(gw["redis_1"], gw["memory_1"], strict=True)]

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    result = {
        "admission_p50_ms": med(adm["redis"], "admit_p50_ms"),
        "admission_p99_ms": med(adm["redis"], "admit_p99_ms"),
        "gateway_rps_1_replica": statistics.median(gw["redis_1"]),
        "gateway_rps_3_replicas": statistics.median(gw["redis_3"]),
        "settle_p50_ms": med(adm["redis"], "settle_p50_ms"),
        "settle_p99_ms": med(adm["redis"], "settle_p99_ms"),
        "redis_ping_p50_ms": med(adm["ping"], "p50_ms"),
        "redis_ping_p99_ms": med(adm["ping"], "p99_ms"),
        "memory_admission_p50_ms": med(adm["memory"], "admit_p50_ms"),
        "memory_admission_p99_ms": med(adm["memory"], "admit_p99_ms"),
        "memory_gateway_rps_1_replica": statistics.median(gw["memory_1"]),
        "gateway_rps_memory": statistics.median(gw["memory_1"]),
        # each run's Redis replica against the memory replica measured next to it
        "gateway_redis_vs_memory": statistics.median(ratios),
        # the gateway's path: StoreDriver awaiting one multiplexed connection
        "awaited_admission_p50_ms": med(awaited, "admit_p50_ms"),
        "awaited_admission_p99_ms": med(awaited, "admit_p99_ms"),
        "awaited_settle_p99_ms": med(awaited, "settle_p99_ms"),
        "awaited_ping_p50_ms": med(awaited, "ping_p50_ms"),
        "awaited_ping_p99_ms": med(awaited, "ping_p99_ms"),
        "round_trips": trips,
        "cluster_admission_p50_ms": med(clustered["redis"], "admit_p50_ms"),
        "cluster_admission_p99_ms": med(clustered["redis"], "admit_p99_ms"),
        "core": core_build(),
        "runs": {
            "admission": adm,
            "awaited_admission": awaited,
            "cluster_admission": clustered,
            "gateway_rps": gw,
            "redis_vs_memory": ratios,
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
