"""Simulator speed: wall time of paper-exp2 and of the scale scenario under `tokenpools`,
with the `none` policy run alongside as the same-run baseline (the engine model and event
loop without admission work), and simulated requests per wall second.

    python benchmarks/simulator.py --json out/simulator.json [--repeats 3]
    python benchmarks/simulator.py --json /tmp/simulator.json --smoke    # the test suite's run

`--simulated-s S` cuts each scenario to its first S simulated seconds; `--smoke` to a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from smoke import parse_args
from tokenpools import core_build
from tokenpools.shipped import SCENARIOS
from tokenpools.sim.scenario import load_scenario
from tokenpools.sim.simulator import simulate

EXPERIMENTS = SCENARIOS
GOALS_S = {"paper-exp2": 3.0, "beyond-scale": 60.0}
# The JSON (paths as in benchmarks/smoke.py): one row per scenario.
FIELDS = (
    "[].scenario", "[].policy", "[].wall_s", "[].wall_s_min", "[].wall_s_max",
    "[].simulated_requests", "[].requests_per_wall_s", "[].baseline_none_wall_s",
    "[].ratio_to_none", "[].goal_s", "[].repeats", "[].core",
)  # fmt: skip
SMOKE = {"repeats": 1, "simulated_s": 60.0}


def time_run(name: str, policy: str, simulated_s: float | None = None) -> tuple[float, int]:
    scenario = load_scenario(EXPERIMENTS / f"{name}.yaml")
    if simulated_s is not None and simulated_s < scenario.duration_s:  # its first seconds only
        scenario = scenario.model_copy(update={"duration_s": simulated_s})
    start = time.perf_counter()
    result = simulate(scenario, policy)
    return time.perf_counter() - start, len(result.attempts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--simulated-s", type=float, help="cut each scenario to its first seconds (default: all)"
    )
    args = parse_args(parser, SMOKE)
    rows = []
    for name, goal in GOALS_S.items():
        walls, base_walls = [], []
        attempts = 0
        for _ in range(args.repeats):
            wall, attempts = time_run(name, "tokenpools", args.simulated_s)
            walls.append(wall)
            base_walls.append(time_run(name, "none", args.simulated_s)[0])
        row = {
            "scenario": name,
            "policy": "tokenpools",
            "wall_s": statistics.median(walls),
            "wall_s_min": min(walls),
            "wall_s_max": max(walls),
            "simulated_requests": attempts,
            "requests_per_wall_s": attempts / statistics.median(walls),
            "baseline_none_wall_s": statistics.median(base_walls),
            "ratio_to_none": statistics.median(walls) / statistics.median(base_walls),
            "goal_s": goal,
            "repeats": args.repeats,
            "core": core_build(),  # "compiled" (mypyc) or "pure Python"
        }
        rows.append(row)
        print(
            f"{name}: {row['wall_s']:.2f} s wall (min {row['wall_s_min']:.2f}, max "
            f"{row['wall_s_max']:.2f}; goal {goal:g} s), {attempts:,} requests, "
            f"{row['requests_per_wall_s']:,.0f} req/s; none {row['baseline_none_wall_s']:.2f} s",
            file=sys.stderr,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
