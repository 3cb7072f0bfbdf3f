"""The operator under failing writes: 12 simulated minutes per seed with a share of all API
writes failing (500) and one namespace refusing every lease pod (403), then one edit. Reports
writes, failed writes, the oldest any virtual node's Lease got (its duration is 40 s), Bound
entitlements lost, lease pods replaced, and the passes until the loop writes nothing more
(tests/kube/soak.py; the test asserts on the same scenario). Against the API-server and
scheduler stand-ins, not a real cluster.

    python benchmarks/operator_faults.py [--seeds 1 2 3] [--rates 0.1 0.2] [--json out.json]
    python benchmarks/operator_faults.py --json /tmp/operator_faults.json --smoke    # the tests'
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' stand-ins

from tests.kube.harness import running_bench
from tests.kube.soak import soak

from smoke import parse_args

# The JSON (paths as in benchmarks/smoke.py): a row per rate and seed, tests/kube/soak.py's
# SoakResult with both.
FIELDS = (
    "[].rate", "[].seed", "[].bound_before", "[].writes", "[].failed", "[].worst_lease_age_s",
    "[].lost", "[].pods_replaced", "[].passes_to_settle", "[].applied_after_edit",
)  # fmt: skip
SMOKE = {"seeds": [1], "rates": [0.2], "minutes": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--minutes", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parse_args(parser, SMOKE)
    logging.disable(logging.WARNING)  # every injected fault is logged otherwise
    rows = []
    for rate in args.rates:
        for seed in args.seeds:
            with running_bench() as bench:
                got = soak(bench, seed, rate, args.minutes)
            row = {"rate": rate, "seed": seed, **asdict(got)}
            row["bound_before"] = sorted(got.bound_before)
            rows.append(row)
            print(
                f"rate {rate:.2f} seed {seed}: {got.writes} writes, {got.failed} failed; "
                f"oldest node Lease {got.worst_lease_age_s:.0f} s; Bound lost {len(got.lost)}; "
                f"lease pods replaced {got.pods_replaced}; settled in {got.passes_to_settle} "
                "passes after one edit"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
