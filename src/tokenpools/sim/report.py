"""Markdown tables from summary.json blocks."""

from __future__ import annotations

from typing import Any

from tokenpools.sim.scenario import Scenario


def _fmt(x: float | None, unit: str = "", digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}{unit}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


MAX_COLUMNS = 6  # above this many tenants, the policy table groups them by service class


def _column_groups(scenario: Scenario, summary: dict[str, Any]) -> dict[str, list[str]]:
    names = [t.name for t in scenario.tenants]
    if len(names) <= MAX_COLUMNS:
        return {n: [n] for n in names}
    block = next(iter(summary["policies"].values()))
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(block["tenants"][n]["class"], []).append(n)
    return groups


def policy_table(scenario: Scenario, summary: dict[str, Any]) -> str:
    """One row per policy: utilisation per phase (all of it / what went into requests that
    were not evicted), the engine queue, and per tenant (or per
    class, for many tenants) the worst phase's P99 TTFT, the share of demand throttled over
    the run (for a class: of its summed demand) and the requests completed."""
    phases = [p.name for p in scenario.phases]
    groups = _column_groups(scenario, summary)
    head = ["policy", *(f"util / useful {p}" for p in phases), "max queue"]
    for g in groups:
        head += [f"{g} P99 TTFT (worst phase)", f"{g} throttled", f"{g} done"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, block in summary["policies"].items():
        cells = [f"`{policy}`"]
        useful = block["useful_utilization"]
        cells += [f"{_pct(block['utilization'][p])} / {_pct(useful[p])}" for p in phases]
        cells.append(str(block["engine"]["max_waiting"]))
        for members in groups.values():
            data = [block["tenants"][m] for m in members]
            worst = [
                m["ttft_p99_s"]
                for d in data
                for m in d["phases"].values()
                if m["ttft_p99_s"] is not None
            ]
            new = sum(d["totals"]["new_requests"] for d in data)
            admitted = sum(d["totals"]["admitted"] for d in data)
            cells.append(_fmt(max(worst) if worst else None, " s"))
            cells.append(_pct(max(0.0, 1 - admitted / new) if new else 0.0))
            cells.append(str(sum(d["totals"]["completed"] for d in data)))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def phase_table(scenario: Scenario, block: dict[str, Any]) -> str:
    head = [
        "tenant",
        "phase",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "E2E p99",
        "sent",
        "admitted",
        "rejected (low prio)",
        "evicted (tokens wasted)",
        "throttled",
        "out tok/s",
        "goodput rps",
        "peak debt",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in scenario.tenants:
        data = block["tenants"][t.name]
        for phase, m in data["phases"].items():
            if m["submitted"] == 0:
                continue
            rows.append(
                "| "
                + " | ".join(
                    [
                        f"{t.name} ({data['class']})",
                        phase,
                        _fmt(m["ttft_p50_s"], " s"),
                        _fmt(m["ttft_p99_s"], " s"),
                        _fmt(m["tpot_p50_s"], " s", 3),
                        _fmt(m["e2e_p99_s"], " s"),
                        str(m["submitted"]),
                        str(m["admitted"]),
                        f"{m['rejected']} ({m['rejected_low_priority']})",
                        f"{m['evicted']} ({m['wasted_output_tokens']})" if m["evicted"] else "0",
                        _pct(m["throttled_fraction"]),
                        _fmt(m["output_tok_s"], "", 1),
                        _fmt(m["goodput_rps"], "", 2),
                        _fmt(data["peak_debt"], "", 3),
                    ]
                )
                + " |"
            )
    return "\n".join(rows)


def waste_table(scenario: Scenario, summary: dict[str, Any]) -> str | None:
    """Per policy, what became of the preemptible tenants' admitted work; None without any."""
    block = next(iter(summary["policies"].values()))
    names = [t.name for t in scenario.tenants if block["tenants"][t.name]["class"] == "preemptible"]
    if not names:
        return None
    head = ["policy", "admitted", "completed", "completed / admitted (ended)", "evicted"]
    head += ["output tokens wasted", "slot-seconds wasted", "suspensions (resumed)"]
    head += ["prompt tokens recomputed"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, b in summary["policies"].items():
        t = [b["tenants"][n]["totals"] for n in names]
        admitted, completed = sum(x["admitted"] for x in t), sum(x["completed"] for x in t)
        ended = admitted - sum(x.get("in_flight_at_end", 0) for x in t)
        cells = [f"`{policy}`", str(admitted), str(completed)]
        cells.append(_fmt(completed / ended if ended else None))
        cells.append(str(sum(x["evicted"] for x in t)))
        cells.append(f"{sum(x['wasted_output_tokens'] for x in t):,}")
        cells.append(f"{sum(x['wasted_slot_s'] for x in t):,.0f}")
        cells.append(f"{sum(x['suspensions'] for x in t):,} ({sum(x['resumed'] for x in t):,})")
        cells.append(f"{sum(x['recomputed_prompt_tokens'] for x in t):,}")
        rows.append("| " + " | ".join(cells) + " |")
    who = ", ".join(names) if len(names) <= 3 else f"{len(names)} tenants"
    return f"Preemptible work ({who}):\n\n" + "\n".join(rows)


def autoscaling_table(scenario: Scenario, summary: dict[str, Any]) -> str:
    """Replicas used against the static peak, and the protected tenants' SLO attainment."""
    spec = scenario.autoscaling
    assert spec is not None
    rows = [
        f"Autoscaling: every {spec.interval_s:g} s; scale-up after {spec.scale_up_delay_s:g} s "
        f"above need, cold start {spec.cold_start_s:g} s; scale-down after "
        f"{spec.scale_down_delay_s:g} s below need. Replica-seconds count replicas starting, "
        "serving and draining.",
        "",
        "| policy | peak replicas | replica-seconds | vs static peak | protected SLO attainment |",
        "|---|---|---|---|---|",
    ]
    blocks = {p: b["replicas"] for p, b in summary["policies"].items() if "replicas" in b}
    static = blocks.get("tokenpools-static-peak")
    for policy, r in blocks.items():
        ratio = r["replica_seconds"] / static["replica_seconds"] if static else None
        rows.append(
            f"| `{policy}` | {r['peak']} | {r['replica_seconds']:,.0f} | {_pct(ratio)} | "
            f"{_pct(r['protected_slo_attainment'])} |"
        )
    return "\n".join(rows)


CLASS_ORDER = ("dedicated", "guaranteed", "elastic", "spot", "preemptible")


def fairness_table(summary: dict[str, Any]) -> str:
    """Per policy, the fairness measures of docs/simulation.md: VTC's service difference
    (worst class), Jain's index over entitled-share-normalised service, SLO attainment per
    class."""
    blocks = summary["policies"]
    present = {c for b in blocks.values() for c in b["fairness"]["slo_attainment"]}
    classes = [c for c in CLASS_ORDER if c in present]
    head = ["policy", "VTC service difference max / mean (tok/s)", "Jain (entitled)"]
    head += [f"{c} SLO attainment" for c in classes]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, b in blocks.items():
        f = b["fairness"]
        diff = f["vtc_service_difference"]
        cells = [f"`{policy}`"]
        cells.append("–" if diff is None else f"{diff['max']:,.0f} / {diff['mean']:,.0f}")
        cells.append(_fmt(f["jain_index"], "", 3))
        cells += [_pct(f["slo_attainment"].get(c)) for c in classes]
        rows.append("| " + " | ".join(cells) + " |")
    note = (
        "Fairness: VTC's service difference within each class of two or more tenants (worst "
        "class; 60 s windows, input + 2 × output tokens), Jain's index of served / "
        "min(entitled, asked) over tenants with a baseline, and per class the share of jobs "
        "completed within their TTFT SLO."
    )
    return note + "\n\n" + "\n".join(rows)


def scenario_report(scenario: Scenario, summary: dict[str, Any], figures: list[str]) -> str:
    parts = [f"## {scenario.name}", "", scenario.description.strip(), ""]
    parts += [
        f"Seed {summary['seed']}, {scenario.duration_s:g} s simulated, engine "
        f"`{scenario.engine.profile}` × {scenario.engine.replicas}. Counts are attempts (HTTP "
        "requests); throttled = 1 − admitted / new requests; TTFT of completed requests.",
        "",
        policy_table(scenario, summary),
        "",
    ]
    if scenario.autoscaling is not None:
        parts += [autoscaling_table(scenario, summary), ""]
    waste = waste_table(scenario, summary)
    if waste is not None:
        parts += [waste, ""]
    parts += [fairness_table(summary), ""]
    for policy in ("tokenpools", "llm-d", "none"):
        if policy in summary["policies"]:
            parts += [
                f"Per phase, `{policy}`:",
                "",
                phase_table(scenario, summary["policies"][policy]),
                "",
            ]
    parts += [f"![{f}]({f})" for f in figures]
    return "\n".join(parts) + "\n"
