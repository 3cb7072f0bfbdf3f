"""Admission-path benchmark: decisions per second and per-decision latency of the decision core
with the in-memory store, for 10, 100 and 1,000 entitlements in one pool.

A decision is one `admit` (admit or reject) plus, for admitted requests, the `settle` that ends
them; the in-flight set is held near the pool's concurrency so the contended, threshold and
eviction paths all run. Virtual time advances 1/300 s per decision (offered load about 1.2×
the pool's throughput). `tick`, which runs the periodic debt/burst update over every entitlement,
is timed apart (`tick_ms`, the median of one call): in virtual time it runs every 4,096
decisions, where a real gateway runs it once per update period (5 s), so folding it into
decisions_per_s would charge each decision for ~100× more updates than production does.

The baseline, measured in the same process and run, is a bare per-key token bucket (what a
plain rate limiter does per request), so `ratio_to_baseline` survives a noisy machine.

    python benchmarks/admission.py --json out/admission.json [--repeats 5] [--decisions 200000]
    python benchmarks/admission.py --json /tmp/admission.json --smoke    # the test suite's run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from smoke import parse_args
from tokenpools import core_build
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit
from tokenpools.model.config import Config, parse_config
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.state.memory import MemoryStore

CLASSES = [
    "guaranteed",
    "dedicated",
    "elastic",
    "elastic",
    "elastic",
    "spot",
    "spot",
    "preemptible",
]
PROTECTED = ("guaranteed", "dedicated")
# Offered load ≈ 1.2 × the pool's 200,000 tokens/s at a mean cost of ~790 tokens per request.
STEP_S = 1 / 300
# The JSON: one row per entitlement count (paths as in benchmarks/smoke.py).
FIELDS = (
    "[].entitlements", "[].decisions_per_s", "[].p50_us", "[].p99_us",
    "[].decisions_per_s_min", "[].decisions_per_s_max", "[].p99_us_max", "[].admitted_fraction",
    "[].tick_ms", "[].baseline_token_bucket_per_s", "[].ratio_to_baseline", "[].repeats",
    "[].core", "[].decisions",
)  # fmt: skip
# enough decisions to fill the pool's 1,024 slots, so the full and evicting paths run
SMOKE = {"repeats": 1, "decisions": 3000}


def build_config(n_entitlements: int, budgets: bool = False) -> Config:
    """One pool of 4 replicas (1,024 slots); half of its slots reserved by the protected
    classes, whatever their number; elastic baselines oversubscribed, as they may be. With
    `budgets`: a monthly budget on every entitlement (large enough never to refuse)."""
    replicas, slots = 4, 256
    n_protected = sum(1 for i in range(n_entitlements) if CLASSES[i % len(CLASSES)] in PROTECTED)
    share = min(8.0, replicas * slots * 0.5 / max(1, n_protected))
    ents: list[dict[str, Any]] = []
    for i in range(n_entitlements):
        cls = CLASSES[i % len(CLASSES)]
        ent: dict[str, Any] = {
            "name": f"e{i}",
            "tenantId": f"t{i}",
            "pool": "p",
            "serviceClass": cls,
            "sloTargetMs": [500, 1000, 5000, 30000][i % 4],
        }
        if cls in PROTECTED:
            ent["concurrency"] = share
        elif cls == "elastic":
            ent["concurrency"] = 4
        ents.append(ent)
    return parse_config(
        {
            "pools": [
                {
                    "name": "p",
                    "model": "Llama-3.1-8B",
                    "perReplica": {
                        "tokensPerSecond": 50_000,
                        "kvTokens": 500_000,
                        "concurrency": slots,
                    },
                    "replicas": replicas,
                    "maxReplicas": 8,
                }
            ],
            "entitlements": ents,
            "policy": {"elasticOversubscription": 100},
            "budgets": [
                {"name": f"b{i}", "entitlement": f"e{i}", "limit": 10**15}
                for i in range(n_entitlements)
                if budgets
            ],
        }
    )


def run_core(
    n_entitlements: int, decisions: int, seed: int, budgets: bool = False, ledger: bool = False
) -> dict[str, float]:
    """With `ledger`, every request counts in a usage-ledger bucket (as the gateway's do);
    with `budgets`, it is also charged to its entitlement's budget."""
    rng = random.Random(seed)
    config = build_config(n_entitlements, budgets)
    core = DecisionCore(config, MemoryStore(), now=0.0)
    names = list(config.entitlements)
    account = Account("t", "key", "model") if budgets or ledger else None
    costs = [
        RequestCost(rng.randint(32, 1024), rng.randint(16, 512), 1, account) for _ in range(4096)
    ]
    picks = [rng.choice(names) for _ in range(4096)]
    usages = [Usage(c.input_tokens, (c.max_output_tokens or 1) // 2) for c in costs]
    inflight: deque[tuple[str, int]] = deque()
    target = 1100  # above the pool's 1,024 slots: contended, full and evicting paths all run
    samples = [0] * decisions
    ticks: list[int] = []
    admitted = 0
    clock = time.perf_counter_ns
    t = 0.0
    start = clock()
    for i in range(decisions):
        t += STEP_S
        j = i & 4095
        t0 = clock()
        decision = core.admit(picks[j], costs[j], t)
        if isinstance(decision, Admit):
            admitted += 1
            inflight.append((decision.lease.lease_id, j))
            for victim in decision.evict:
                core.release(victim.lease_id, t, refund=False)
        if len(inflight) > target or (inflight and not isinstance(decision, Admit)):
            lease_id, k = inflight.popleft()
            core.settle(lease_id, usages[k], t)
        samples[i] = clock() - t0
        if j == 0:
            t1 = clock()
            core.tick(t)
            ticks.append(clock() - t1)
    wall = (clock() - start - sum(ticks)) / 1e9
    samples.sort()
    return {
        "decisions_per_s": decisions / wall,
        "p50_us": samples[len(samples) // 2] / 1000,
        "p99_us": samples[int(len(samples) * 0.99)] / 1000,
        "admitted_fraction": admitted / decisions,
        "tick_ms": statistics.median(ticks) / 1e6,
    }


def run_baseline(n_keys: int, decisions: int, seed: int) -> float:
    """A per-key token bucket: refill, compare, subtract. Returns checks per second."""
    rng = random.Random(seed)
    levels = [1000.0] * n_keys
    last = [0.0] * n_keys
    picks = [rng.randrange(n_keys) for _ in range(4096)]
    t = 0.0
    start = time.perf_counter_ns()
    for i in range(decisions):
        t += 0.001
        k = picks[i & 4095]
        level = min(1000.0, levels[k] + (t - last[k]) * 100.0)
        last[k] = t
        if level >= 300.0:
            level -= 300.0
        levels[k] = level
    return decisions / ((time.perf_counter_ns() - start) / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decisions", type=int, default=200_000)
    args = parse_args(parser, SMOKE)
    rows = []
    for n in (10, 100, 1000):
        runs = []
        baselines = []
        for r in range(args.repeats):
            baselines.append(run_baseline(n, args.decisions, seed=r))
            runs.append(run_core(n, args.decisions, seed=r))
        rate = [x["decisions_per_s"] for x in runs]
        row = {
            "entitlements": n,
            "decisions_per_s": statistics.median(rate),
            "p50_us": statistics.median(x["p50_us"] for x in runs),
            "p99_us": statistics.median(x["p99_us"] for x in runs),
            "decisions_per_s_min": min(rate),
            "decisions_per_s_max": max(rate),
            "p99_us_max": max(x["p99_us"] for x in runs),
            "admitted_fraction": statistics.median(x["admitted_fraction"] for x in runs),
            "tick_ms": statistics.median(x["tick_ms"] for x in runs),
            "baseline_token_bucket_per_s": statistics.median(baselines),
            "ratio_to_baseline": statistics.median(rate) / statistics.median(baselines),
            "repeats": args.repeats,
            "core": core_build(),  # "compiled" (mypyc) or "pure Python"
            "decisions": args.decisions,
        }
        rows.append(row)
        print(
            f"{n:>5} entitlements: {row['decisions_per_s']:>9,.0f} decisions/s "
            f"(min {row['decisions_per_s_min']:,.0f}, max {row['decisions_per_s_max']:,.0f}), "
            f"p50 {row['p50_us']:.1f} µs, p99 {row['p99_us']:.1f} µs, "
            f"admitted {row['admitted_fraction']:.0%}, tick {row['tick_ms']:.2f} ms, "
            f"{row['ratio_to_baseline']:.3f}× a bare token bucket",
            file=sys.stderr,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
