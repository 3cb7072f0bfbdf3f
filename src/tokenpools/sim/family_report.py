"""The generated families in the experiments report: every policy on a slice of the preemptible
family (sim/family.py) and of the fair-share family (sim/family_fair.py), read as
sim/family_eval.py reads a run, aggregated per policy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenpools.sim.family import family_scenario
from tokenpools.sim.family_eval import aggregate, run_family
from tokenpools.sim.family_fair import fair_scenario
from tokenpools.sim.scenario import Scenario

FAMILIES: dict[str, Callable[[int], Scenario]] = {
    "preemptible": family_scenario,
    "fair-share": fair_scenario,
}
CLASSES = ("dedicated", "guaranteed", "elastic", "spot", "preemptible")


def run_families(
    policies: Sequence[str],
    members: int,
    seeds: Sequence[int] = (1,),
    scheduling: str = "fcfs",
) -> dict[str, dict[str, Any]]:
    """family → policy → the aggregate of its runs (members 0..members-1 × seeds), on
    engines that schedule by `scheduling` (Scenario.on_engines)."""
    return {
        name: {
            p: aggregate(run_family(range(members), seeds, [p], _on(family, scheduling)))
            for p in policies
        }
        for name, family in FAMILIES.items()
    }


def _on(family: Callable[[int], Scenario], scheduling: str) -> Callable[[int], Scenario]:
    """The family's members on engines that schedule by `scheduling`."""
    return lambda member: family(member).on_engines(scheduling)


def _f(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _split(split: dict[str, float | None] | None) -> str:
    if not split:
        return "–"
    return f"{_f(split['within'], '.0%')} / {_f(split['above'], '.0%')}"


def family_table(aggregates: dict[str, Any]) -> str:
    head = [
        "policy",
        "promised phases within SLO",
        "protected P99 TTFT mean / worst",
        "surplus goodput (out tok/s)",
        "util / useful",
        "preemptible completed / ended",
        "output thrown away",
        "suspensions (P50 / P99 s suspended)",
        "prompt recomputed",
        "VTC service difference (mean of worst windows)",
        "Jain (entitled)",
        *(f"{c} SLO attainment" for c in CLASSES),
        "guaranteed SLO attainment within / above its entitlement",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, a in aggregates.items():
        cells = [
            f"`{policy}`",
            f"{a['promised_phases_met']} / {a['promised_phases']}",
            f"{_f(a['promised_p99_ttft_mean_s'], '.2f')} / "
            f"{_f(a['promised_p99_ttft_worst_s'], '.2f')} s",
            _f(a["surplus_goodput_tok_s"], ".1f"),
            f"{a['utilization']:.0%} / {a['useful_utilization']:.0%}",
            f"{a['preemptible_completed']} / {a['preemptible_ended']}",
            _f(a["thrown_away_output_share"], ".2%"),
            f"{a['suspensions']:,} ({_f(a['suspended_p50_s'], '.1f')} / "
            f"{_f(a['suspended_p99_s'], '.1f')})",
            _f(a["recomputed_prompt_share"], ".1%"),
            _f(a["service_difference_mean"], ",.0f"),
            _f(a["jain_index_mean"], ".3f"),
            *(_f(a["slo_attainment"].get(c), ".0%") for c in CLASSES),
            _split(a["slo_attainment_split"].get("guaranteed")),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def families_report(
    results: dict[str, dict[str, Any]],
    members: int,
    seeds: Sequence[int],
    scheduling: str = "fcfs",
) -> str:
    parts = [
        f"## Generated families, engines scheduling {scheduling}",
        "",
        f"Members 0–{members - 1} of each family, seeds {', '.join(map(str, seeds))}, under "
        "every policy. *Promised* phases are a protected tenant's phases within its baseline "
        "on capacity that holds every protected baseline; its P99 TTFT there is compared with "
        "its SLO. Surplus goodput: output tokens per second of the spot and preemptible "
        "requests that completed. Output thrown away: of all output generated, what ended "
        "requests had generated for nothing; prompt recomputed: of all admitted prompt tokens, "
        "what resumed requests' engines prefilled again. Fairness measures as in each scenario "
        "(means over members "
        "where they apply).",
        "",
    ]
    for name, aggregates in results.items():
        parts += [f"### {name} family", "", family_table(aggregates), ""]
    return "\n".join(parts)
