"""Running the preemptible family (sim/family.py) and reading what matters from each run:
what became of the preemptible work admitted, what the evicted part wasted, how much of the
pool did useful work, and whether the protected tenants met their TTFT SLO in each phase."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenpools.model.service_class import ServiceClass
from tokenpools.sim.family import family_scenario, protected_phases
from tokenpools.sim.metrics import percentile, summarize
from tokenpools.sim.scenario import Scenario
from tokenpools.sim.simulator import simulate

# completed / admitted is judged where at least this many admitted requests ended.
MIN_ADMITTED = 20
SURPLUS = (ServiceClass.SPOT, ServiceClass.PREEMPTIBLE)


@dataclass(frozen=True, slots=True)
class PhaseCheck:
    tenant: str
    phase: str
    within_baseline: bool
    slo_ttft_s: float
    ttft_p99_s: float | None
    rejected: int

    @property
    def met(self) -> bool:
        return self.ttft_p99_s is None or self.ttft_p99_s <= self.slo_ttft_s


@dataclass(frozen=True, slots=True)
class MemberRun:
    index: int
    seed: int
    policy: str
    ended: int  # preemptible attempts admitted that ended (completed or evicted)
    completed: int
    wasted_output_tokens: int
    wasted_slot_s: float
    utilization: float  # mean over phases
    useful_utilization: float
    phases: tuple[PhaseCheck, ...]
    surplus_goodput: float = 0.0  # output tokens/s of spot and preemptible requests completed
    jain_index: float | None = None  # the summary's fairness measures (sim/fairness.py)
    service_difference: float | None = None  # VTC's, worst class, worst window
    slo_attainment: tuple[tuple[str, float | None], ...] = ()  # per class
    # per class: (within the entitlement, above it), where the policy says which is which
    slo_split: tuple[tuple[str, float | None, float | None], ...] = ()
    # suspension, over every tenant: attempts suspended, each one's time suspended in all,
    # prompt tokens prefilled again by continuations against all prompt tokens admitted, and
    # output tokens thrown away (ended attempts) against all generated
    suspended_s: tuple[float, ...] = ()
    suspensions: int = 0
    recomputed_tokens: int = 0
    prompt_tokens: int = 0
    thrown_away_tokens: int = 0
    output_tokens: int = 0

    @property
    def completed_per_admitted(self) -> float | None:
        return self.completed / self.ended if self.ended else None

    @property
    def judged(self) -> bool:
        return self.ended >= MIN_ADMITTED


def run_member(
    index: int, seed: int, policy: str, family: Callable[[int], Scenario] = family_scenario
) -> MemberRun:
    scenario = family(index)
    result = simulate(scenario, policy, seed)
    block = summarize(result)
    shed = [t for t in block["tenants"].values() if t["class"] == "preemptible"]
    batch = {
        k: sum(t["totals"][k] for t in shed)
        for k in ("admitted", "in_flight_at_end", "completed", "wasted_output_tokens")
    }
    batch["wasted_slot_s"] = sum(t["totals"]["wasted_slot_s"] for t in shed)
    surplus = sum(
        a.output_tokens
        for a in result.attempts
        if a.outcome == "completed"
        and result.config.entitlements[a.req.entitlement].service_class in SURPLUS
    )
    fairness = block["fairness"]
    diff = fairness["vtc_service_difference"]
    admitted = [a for a in result.attempts if a.outcome not in ("rejected", "pending")]
    suspended = [a for a in admitted if a.suspensions]
    checks = []
    for pp in protected_phases(scenario):
        m = block["tenants"][pp.tenant]["phases"][pp.phase]
        checks.append(
            PhaseCheck(
                pp.tenant,
                pp.phase,
                pp.within_baseline,
                pp.slo_ttft_s,
                m["ttft_p99_s"],
                m["rejected"],
            )
        )
    return MemberRun(
        index,
        seed,
        policy,
        batch["admitted"] - batch["in_flight_at_end"],
        batch["completed"],
        batch["wasted_output_tokens"],
        batch["wasted_slot_s"],
        statistics.fmean(block["utilization"].values()),
        statistics.fmean(block["useful_utilization"].values()),
        tuple(checks),
        surplus / scenario.duration_s,
        fairness["jain_index"],
        None if diff is None else diff["max"],
        tuple(fairness["slo_attainment"].items()),
        tuple((c, v["within"], v["above"]) for c, v in fairness["slo_attainment_split"].items()),
        tuple(a.suspended_s for a in suspended),
        sum(a.suspensions for a in suspended),
        sum(a.recomputed_tokens for a in suspended),
        sum(a.req.prompt_tokens for a in admitted),
        sum(a.output_tokens for a in admitted if a.outcome == "evicted"),
        sum(a.output_tokens for a in admitted),
    )


def run_family(
    indices: Iterable[int],
    seeds: Sequence[int],
    policies: Sequence[str],
    family: Callable[[int], Scenario] = family_scenario,
) -> list[MemberRun]:
    return [run_member(i, s, p, family) for i in indices for s in seeds for p in policies]


def aggregate(runs: Sequence[MemberRun]) -> dict[str, Any]:
    """The family's verdict for one policy's runs."""
    judged = [r for r in runs if r.judged]
    ratios = [r.completed_per_admitted or 0.0 for r in judged]
    promised = [c for r in runs for c in r.phases if c.within_baseline]
    p99s = [c.ttft_p99_s for c in promised if c.ttft_p99_s is not None]
    ended = sum(r.ended for r in runs)
    return {
        "runs": len(runs),
        "judged_runs": len(judged),
        "judged_below_half": sum(x < 0.5 for x in ratios),
        "worst_completed_per_admitted": round(min(ratios), 4) if ratios else None,
        "median_completed_per_admitted": round(statistics.median(ratios), 4) if ratios else None,
        "preemptible_ended": ended,
        "preemptible_completed": sum(r.completed for r in runs),
        "completed_per_admitted": round(sum(r.completed for r in runs) / ended, 4)
        if ended
        else None,
        "wasted_output_tokens": sum(r.wasted_output_tokens for r in runs),
        "wasted_slot_s": round(sum(r.wasted_slot_s for r in runs), 1),
        "utilization": round(statistics.fmean(r.utilization for r in runs), 4),
        "useful_utilization": round(statistics.fmean(r.useful_utilization for r in runs), 4),
        "promised_phases": len(promised),
        "promised_phases_met": sum(c.met for c in promised),
        "promised_met_share": round(sum(c.met for c in promised) / len(promised), 4)
        if promised
        else None,
        "promised_p99_ttft_mean_s": round(statistics.fmean(p99s), 4) if p99s else None,
        "promised_p99_ttft_worst_s": round(max(p99s), 4) if p99s else None,
        "promised_rejected": sum(c.rejected for c in promised),
        "surplus_goodput_tok_s": round(statistics.fmean(r.surplus_goodput for r in runs), 2),
        "jain_index_mean": _mean([r.jain_index for r in runs]),
        "service_difference_mean": _mean([r.service_difference for r in runs]),
        "suspensions": sum(r.suspensions for r in runs),
        "suspended_p50_s": _percentile([x for r in runs for x in r.suspended_s], 50),
        "suspended_p99_s": _percentile([x for r in runs for x in r.suspended_s], 99),
        "recomputed_prompt_share": _share(
            sum(r.recomputed_tokens for r in runs), sum(r.prompt_tokens for r in runs)
        ),
        "thrown_away_output_share": _share(
            sum(r.thrown_away_tokens for r in runs), sum(r.output_tokens for r in runs)
        ),
        "slo_attainment_split": {
            cls: {
                "within": _mean([w for r in runs for c, w, _ in r.slo_split if c == cls]),
                "above": _mean([a for r in runs for c, _, a in r.slo_split if c == cls]),
            }
            for cls in sorted({row[0] for r in runs for row in r.slo_split})
        },
        "slo_attainment": {
            cls: _mean([dict(r.slo_attainment).get(cls) for r in runs])
            for cls in sorted({c for r in runs for c, _ in r.slo_attainment})
        },
    }


def _percentile(values: Sequence[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value, 3)


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 5) if whole else None


def _mean(values: Sequence[float | None]) -> float | None:
    """The mean of the runs where the measure applies."""
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 4) if present else None
