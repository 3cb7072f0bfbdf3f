"""Admission with a budget on every entitlement against admission without, alternating in one
run (this machine is shared and noisy): decisions per second with the in-memory store, for 10,
100 and 1,000 entitlements, and their ratio (the goal: >= 0.9). Three variants: no metering
at all (the simulator's requests), the usage ledger only (every gateway request), and the
ledger plus a budget on every entitlement.

    python benchmarks/budgets.py --json out/budgets.json --repeats 5
    python benchmarks/budgets.py --json /tmp/budgets.json --smoke    # the test suite's run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from admission import run_core
from smoke import parse_args

# The JSON: one row per entitlement count (paths as in benchmarks/smoke.py).
FIELDS = (
    "[].entitlements", "[].without_per_s", "[].ledger_only_per_s", "[].ratio_to_ledger_only",
    "[].with_budgets_per_s", "[].without_range", "[].with_budgets_range", "[].ratio",
    "[].repeats",
)  # fmt: skip
SMOKE = {"repeats": 1, "decisions": 3000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decisions", type=int, default=100_000)
    args = parse_args(parser, SMOKE)
    rows = []
    for n in (10, 100, 1000):
        without, ledger, with_budgets = [], [], []
        for r in range(args.repeats):  # alternated, so drift hits all alike
            without.append(run_core(n, args.decisions, r)["decisions_per_s"])
            ledger.append(run_core(n, args.decisions, r, ledger=True)["decisions_per_s"])
            with_budgets.append(run_core(n, args.decisions, r, budgets=True)["decisions_per_s"])
        row = {
            "entitlements": n,
            "without_per_s": statistics.median(without),
            "ledger_only_per_s": statistics.median(ledger),
            "ratio_to_ledger_only": statistics.median(
                b / a for a, b in zip(ledger, with_budgets, strict=True)
            ),
            "with_budgets_per_s": statistics.median(with_budgets),
            "without_range": [min(without), max(without)],
            "with_budgets_range": [min(with_budgets), max(with_budgets)],
            "ratio": statistics.median(b / a for a, b in zip(without, with_budgets, strict=True)),
            "repeats": args.repeats,
        }
        rows.append(row)
        print(
            f"{n:>5} entitlements: without {row['without_per_s']:,.0f}/s, ledger only "
            f"{row['ledger_only_per_s']:,.0f}/s, with budgets {row['with_budgets_per_s']:,.0f}/s;"
            f" ratio {row['ratio']:.3f} (to ledger only {row['ratio_to_ledger_only']:.3f})",
            file=sys.stderr,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
