"""The preemptible family (tokenpools/sim/family.py) under tokenpools as it is here and, with
--baseline-src, as it was at another checkout (e.g. a `git worktree` of the commit before a
change), plus any other policies: per member and in aggregate, what became of the
preemptible work admitted, what the evicted part wasted, the utilisation and the useful-work
utilisation, and the protected tenants' P99 TTFT against their SLO where they stay within
their baselines. The simulator is deterministic, so one run of each is the measurement.

The baseline's admission code is its own; the scenarios and the measurement are this
checkout's (sim/family.py, sim/family_eval.py and sim/metrics.py are laid over a copy of the
baseline's source), so both are judged on the same members by the same rules.

    python benchmarks/preemptible_family.py --json out/family.json --members 60 \
        --baseline-src /tmp/base --policies none,priority-shed
    python benchmarks/preemptible_family.py --json /tmp/family.json --smoke  # the tests' run

`--smoke`: member 0, seed 1, with `none` beside tokenpools and this checkout as its own
baseline, so every path runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from smoke import parse_args

ROOT = Path(__file__).resolve().parent.parent
MEASUREMENT = ("family.py", "family_eval.py", "metrics.py")  # laid over a baseline's sim/
# The JSON (paths as in benchmarks/smoke.py): per policy (and "tokenpools (baseline)" with
# --baseline-src) the aggregate of sim/family_eval.py and every run.
FIELDS = (
    "members", "first", "seeds",
    "aggregate.tokenpools.runs", "aggregate.tokenpools.judged_runs",
    "aggregate.tokenpools.judged_below_half", "aggregate.tokenpools.worst_completed_per_admitted",
    "aggregate.tokenpools.median_completed_per_admitted", "aggregate.tokenpools.preemptible_ended",
    "aggregate.tokenpools.preemptible_completed", "aggregate.tokenpools.completed_per_admitted",
    "aggregate.tokenpools.wasted_output_tokens", "aggregate.tokenpools.wasted_slot_s",
    "aggregate.tokenpools.utilization", "aggregate.tokenpools.useful_utilization",
    "aggregate.tokenpools.promised_phases", "aggregate.tokenpools.promised_phases_met",
    "aggregate.tokenpools.promised_met_share", "aggregate.tokenpools.promised_p99_ttft_mean_s",
    "aggregate.tokenpools.promised_p99_ttft_worst_s", "aggregate.tokenpools.promised_rejected",
    "aggregate.*.runs", "aggregate.*.preemptible_ended", "aggregate.*.useful_utilization",
    "runs.tokenpools.[].index", "runs.tokenpools.[].seed", "runs.tokenpools.[].policy",
    "runs.tokenpools.[].ended", "runs.tokenpools.[].completed",
    "runs.tokenpools.[].wasted_output_tokens", "runs.tokenpools.[].wasted_slot_s",
    "runs.tokenpools.[].utilization", "runs.tokenpools.[].useful_utilization",
    "runs.tokenpools.[].phases", "runs.*.[].policy",
)  # fmt: skip
SMOKE = {"members": 1, "seeds": "1", "policies": "none", "baseline_src": ROOT}


def worker(first: int, members: int, seeds: list[int], policies: list[str]) -> None:
    from tokenpools.sim.family_eval import run_family

    runs = run_family(range(first, first + members), seeds, policies)
    json.dump([asdict(r) for r in runs], sys.stdout)


def run_source(src: Path, args: argparse.Namespace, policies: list[str]) -> list[dict]:
    """Run the worker on the tokenpools package under `src` (a checkout's root)."""
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "tokenpools"
        shutil.copytree(src / "src" / "tokenpools", package)
        for name in MEASUREMENT:
            shutil.copy(ROOT / "src" / "tokenpools" / "sim" / name, package / "sim" / name)
        env = {**os.environ, "PYTHONPATH": tmp, "TOKENPOOLS_PURE": "1"}
        command = [sys.executable, __file__, "--worker", "--first", str(args.first)]
        command += ["--members", str(args.members), "--seeds", args.seeds]
        command += ["--policies", ",".join(policies)]
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--members", type=int, default=60)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--baseline-src", type=Path)
    parser.add_argument("--policies", default="", help="other policies, e.g. none,priority-shed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parse_args(parser, SMOKE)
    seeds = [int(s) for s in args.seeds.split(",")]
    others = [p for p in args.policies.split(",") if p]
    if args.worker:
        worker(args.first, args.members, seeds, others)
        return
    from tokenpools.sim.family_eval import MemberRun, PhaseCheck, aggregate

    def load(rows: list[dict]) -> list[MemberRun]:
        return [
            MemberRun(**{**r, "phases": tuple(PhaseCheck(**p) for p in r["phases"])}) for r in rows
        ]

    results: dict[str, list[MemberRun]] = {
        "tokenpools": load(run_source(ROOT, args, ["tokenpools", *others]))
    }
    for policy in others:
        results[policy] = [r for r in results["tokenpools"] if r.policy == policy]
    results["tokenpools"] = [r for r in results["tokenpools"] if r.policy == "tokenpools"]
    if args.baseline_src is not None:
        results["tokenpools (baseline)"] = load(run_source(args.baseline_src, args, ["tokenpools"]))
    report = {
        "members": args.members,
        "first": args.first,
        "seeds": seeds,
        "aggregate": {name: aggregate(runs) for name, runs in results.items()},
        "runs": {name: [asdict(r) for r in runs] for name, runs in results.items()},
    }
    for name, summary in report["aggregate"].items():
        print(f"{name}: {json.dumps(summary)}", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
