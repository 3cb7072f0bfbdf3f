"""Run scenarios under policies and write summary.json, report.md and figures."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenpools.sim.family_report import families_report, run_families
from tokenpools.sim.metrics import summarize
from tokenpools.sim.report import scenario_report
from tokenpools.sim.scenario import Scenario, load_scenario
from tokenpools.sim.simulator import RunResult, simulate

Progress = Callable[[str, float], None]  # (policy, simulated time)
log = logging.getLogger("tokenpools.sim")
STATIC_PEAK = "tokenpools-static-peak"  # tokenpools on maxReplicas throughout
FAMILY_MEMBERS = 12  # of each generated family, in the experiments report
ENGINES = ("fcfs", "priority")  # the engines' scheduling policies the experiments run on


def run_scenario(
    scenario: Scenario,
    policies: Sequence[str],
    seed: int | None = None,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], list[RunResult]]:
    results = []
    for policy in policies:
        callback = None if progress is None else (lambda t, p=policy: progress(p, t))
        results.append(simulate(scenario, policy, seed, progress=callback))
    if scenario.autoscaling is not None and "tokenpools" in policies:
        # The autoscaled pool against provisioning its peak all the time, same demand.
        static = simulate(scenario.static_peak(), "tokenpools", seed)
        results.append(replace(static, policy=STATIC_PEAK))
    summary = {
        "scenario": scenario.name,
        "seed": results[0].seed,
        "policies": {r.policy: summarize(r) for r in results},
    }
    return summary, results


def write_outputs(
    scenario: Scenario,
    summary: dict[str, Any],
    results: list[RunResult],
    out: Path,
    figures: bool = True,
) -> str:
    """Write summary.json, report.md and (unless `figures` is False) the figures into `out`;
    return the report text."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    written = write_figures(results, out) if figures else []
    report = scenario_report(scenario, summary, [p.name for p in written])
    (out / "report.md").write_text(report)
    return report


def write_figures(results: list[RunResult], out: Path) -> list[Path]:
    """The PNG figures, when matplotlib is installed (the `sim` extra); else none, said once."""
    try:
        from tokenpools.sim import figures
    except ImportError:
        log.warning("figures skipped: they need matplotlib (pip install 'tokenpools[sim]')")
        return []
    return figures.write_figures(results, out)


def run_experiments(
    folder: Path,
    out: Path,
    policies: Sequence[str],
    seed: int | None = None,
    progress: Callable[[str, str, float], None] | None = None,
    family_members: int = FAMILY_MEMBERS,
    engines: Sequence[str] = ENGINES,
) -> Path:
    """Every scenario in `folder` under every policy, then a slice of each generated family
    (`family_members` members, 0 for none), on engines of each scheduling policy in `engines`
    (fcfs: into `out`; another: into `out/<policy>-engines`); one REPORT.md linking them all,
    families.json with each's aggregates by engine scheduling."""
    sections, families = [], {}
    for scheduling in engines:
        where = Path(".") if scheduling == "fcfs" else Path(f"{scheduling}-engines")
        sections.append(f"# Engines scheduling {scheduling}\n")
        for path in sorted(folder.glob("*.yaml")):
            scenario = load_scenario(path).on_engines(scheduling)
            if progress is None:
                callback = None
            else:
                shown = scenario.name if scheduling == "fcfs" else f"{scenario.name} ({scheduling})"
                callback = lambda p, t, s=shown: progress(s, p, t)  # noqa: E731
            summary, results = run_scenario(scenario, policies, seed, callback)
            folder_of = where / scenario.name
            # figures for the fcfs run only: the priority run's would double the report's size
            # for curves its tables already compare
            report = write_outputs(
                scenario, summary, results, out / folder_of, figures=scheduling == "fcfs"
            )
            # Figures live next to each scenario's report; point the combined report at them.
            sections.append(re.sub(r"!\[([^\]]*)\]\(", rf"![\1]({folder_of.as_posix()}/", report))
        if family_members > 0:
            families[scheduling] = run_families(policies, family_members, (1,), scheduling)
            sections.append(families_report(families[scheduling], family_members, (1,), scheduling))
    if families:
        (out / "families.json").write_text(json.dumps(families, indent=2) + "\n")
    index = out / "REPORT.md"
    index.write_text(
        "# Experiments\n\nEvery scenario of `experiments/` under every policy, on engines that "
        "schedule first come first served (vLLM's default) and by priority (`--scheduling-policy "
        "priority`), written by `tokenpools experiments`. Each scenario's folder holds its "
        "summary.json; the generated families' aggregates are in families.json, by engine "
        "scheduling.\n\n" + "\n".join(sections)
    )
    return index
