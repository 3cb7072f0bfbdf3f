"""A gateway restarted under load: how long surplus work (spot, preemptible) is held back
after the restart, and what the protected tenants' first-token latency pays, in the simulator
on the shipped `beyond-restart` scenario (two restarts, at 100 s and 200 s), over several
seeds, with each kind of store:

- `empty`: the memory store, lost with the process (the new one knows nothing in flight);
- `kept`: a shared store (Redis) that outlives the process, leases and measurements kept.

Per store, for each 10 s after a restart (both restarts pooled): surplus work in flight as a
fraction of its steady level (50–100 s), the median over seeds; and the protected tenants'
(guaranteed, dedicated) P99 TTFT before (30–100 s) and in the 60 s after each restart.

    python benchmarks/restart.py --json out/restart.json [--seeds 8]
    python benchmarks/restart.py --json /tmp/restart.json --smoke    # the test suite's run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from smoke import parse_args
from tokenpools.shipped import scenario_path
from tokenpools.sim.records import RunResult
from tokenpools.sim.scenario import load_scenario
from tokenpools.sim.simulator import simulate

SURPLUS = ("scrape", "batch")
PROTECTED = ("api", "chat")
STEPS_S = tuple(range(0, 100, 10))
FIELDS = (
    "stores.*.surplus_after_restart.[].from_s", "stores.*.surplus_after_restart.[].fraction",
    "stores.*.recovered_after_s", "stores.*.protected_p99_ttft_before_s",
    "stores.*.protected_p99_ttft_after_s", "stores.*.evicted", "seeds", "scenario",
)  # fmt: skip
SMOKE = {"seeds": 1}


def surplus(result: RunResult, start: float, end: float) -> float:
    counts = [
        sum(s.running_by_tenant.get(n, 0) for n in SURPLUS)
        for s in result.samples
        if start <= s.t < end
    ]
    return statistics.mean(counts)


def p99_ttft(result: RunResult, start: float, end: float) -> float:
    ttfts = sorted(
        a.first_token_at - a.req.sent_at
        for a in result.attempts
        if a.req.tenant in PROTECTED
        and a.first_token_at is not None
        and start <= a.req.sent_at < end
    )
    return ttfts[int(0.99 * len(ttfts))]


def measure(store: str, seeds: int) -> dict[str, Any]:
    scenario = load_scenario(scenario_path("beyond-restart"))
    restarts = [r.model_copy(update={"store": store}) for r in scenario.restarts]
    scenario = scenario.model_copy(update={"restarts": restarts})
    fractions: dict[int, list[float]] = {step: [] for step in STEPS_S}
    before, after, evicted = [], [], []
    for seed in range(1, seeds + 1):
        result = simulate(scenario, "tokenpools", seed)
        steady = surplus(result, 50, 100)
        for step in STEPS_S:
            pooled = statistics.mean(
                surplus(result, r.at_s + step, r.at_s + step + 10) for r in restarts
            )
            fractions[step].append(pooled / steady)
        before.append(p99_ttft(result, 30, 100))
        after.append(max(p99_ttft(result, r.at_s, r.at_s + 60) for r in restarts))
        evicted.append(sum(1 for a in result.attempts if a.outcome == "evicted"))
    rows = [{"from_s": s, "fraction": statistics.median(fractions[s])} for s in STEPS_S]
    # the first step from which surplus work stays at >= 90 % of its steady level
    recovered = next(
        (r["from_s"] for i, r in enumerate(rows) if all(x["fraction"] >= 0.9 for x in rows[i:])),
        None,
    )
    return {
        "surplus_after_restart": rows,
        "recovered_after_s": recovered,  # None: not within 100 s
        "protected_p99_ttft_before_s": statistics.median(before),
        "protected_p99_ttft_after_s": statistics.median(after),
        "evicted": statistics.median(evicted),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--seeds", type=int, default=8)
    args = parse_args(parser, SMOKE)
    stores = {store: measure(store, args.seeds) for store in ("empty", "kept")}
    for store, row in stores.items():
        steps = " ".join(
            f"+{r['from_s']}s {r['fraction']:.2f}" for r in row["surplus_after_restart"]
        )
        print(
            f"{store:>5}: surplus in flight after a restart (× steady): {steps}; at >= 90 % "
            f"from +{row['recovered_after_s']} s; protected P99 TTFT "
            f"{row['protected_p99_ttft_before_s']:.2f} s before, "
            f"{row['protected_p99_ttft_after_s']:.2f} s after; evicted {row['evicted']:.0f}",
            file=sys.stderr,
        )
    out = {"scenario": "beyond-restart", "seeds": args.seeds, "stores": stores}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
