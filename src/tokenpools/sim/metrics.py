"""From a run's records to the summary.json contract (docs/simulation.md).

Counts are per attempt (an HTTP request): a job retried three times is three `submitted`.
`new_requests` counts jobs (first attempts) and `throttled_fraction` = 1 − admitted/new_requests
is the share of a tenant's demand it could not get admitted — the paper's "47% of spot
throttled". Latencies are per completed attempt, from the moment it was sent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from tokenpools.sim.fairness import fairness_block, jobs_within_slo
from tokenpools.sim.records import Attempt, RunResult

DIGITS = 4


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, DIGITS)


def tenant_metrics(
    attempts: Iterable[Attempt],
    seconds: float,
    output_tokens: int,
    slo_ttft_s: float | None,
    slo_tpot_s: float | None,
) -> dict[str, Any]:
    attempts = list(attempts)
    ttft, tpot, e2e = [], [], []
    good = 0
    counts: dict[str, int] = defaultdict(int)
    wasted = [0.0, 0.0, 0.0]  # output tokens, slot-seconds, KV-token-seconds of evictions
    suspended_s: list[float] = []  # per suspended attempt, its time suspended in all
    recomputed = resumed = 0
    for a in attempts:
        counts[a.outcome] += 1
        if a.suspensions:
            suspended_s.append(a.suspended_s)
            counts["suspensions"] += a.suspensions
            recomputed += a.recomputed_tokens
            resumed += a.resumes
        if a.outcome == "evicted":
            wasted[0] += a.output_tokens
            wasted[1] += a.wasted_slot_s
            wasted[2] += a.wasted_kv_token_s
        if a.outcome == "rejected" and a.reason == "low_priority":
            counts["low_priority"] += 1
        if a.number == 1:
            counts["new"] += 1
        if a.outcome != "completed" or a.first_token_at is None or a.finished_at is None:
            continue
        first = a.first_token_at - a.req.sent_at
        ttft.append(first)
        e2e.append(a.finished_at - a.req.sent_at)
        per_token = (
            (a.finished_at - a.first_token_at) / (a.output_tokens - 1)
            if a.output_tokens > 1
            else None
        )
        if per_token is not None:
            tpot.append(per_token)
        if (slo_ttft_s is None or first <= slo_ttft_s) and (
            slo_tpot_s is None or per_token is None or per_token <= slo_tpot_s
        ):
            good += 1
    submitted = len(attempts)
    admitted = submitted - counts["rejected"]
    ended = admitted - counts["pending"]
    new = counts["new"]
    return {
        "ttft_p50_s": _r(percentile(ttft, 50)),
        "ttft_p99_s": _r(percentile(ttft, 99)),
        "tpot_p50_s": _r(percentile(tpot, 50)),
        "e2e_p99_s": _r(percentile(e2e, 99)),
        "submitted": submitted,
        "admitted": admitted,
        "completed": counts["completed"],
        "rejected": counts["rejected"],
        "rejected_low_priority": counts["low_priority"],
        "evicted": counts["evicted"],
        "in_flight_at_end": counts["pending"],
        # of the admitted attempts that ended: one still running when the run stops is
        # neither worth nor wasted anything yet
        "completed_per_admitted": _r(counts["completed"] / ended if ended else None),
        "wasted_output_tokens": int(wasted[0]),
        "wasted_slot_s": _r(wasted[1]),
        "wasted_kv_token_s": _r(wasted[2]),
        "suspended": len(suspended_s),  # attempts suspended at least once
        "suspensions": counts["suspensions"],
        "resumed": resumed,  # continuations admitted
        "suspended_p50_s": _r(percentile(suspended_s, 50)),
        "suspended_p99_s": _r(percentile(suspended_s, 99)),
        "recomputed_prompt_tokens": recomputed,  # prefilled again by continuations
        "output_tok_s": _r(output_tokens / seconds if seconds > 0 else 0.0),
        "goodput_rps": _r(good / seconds if seconds > 0 else 0.0),
        "new_requests": new,
        "throttled_fraction": _r(max(0.0, 1.0 - admitted / new) if new else 0.0),
    }


def summarize(result: RunResult) -> dict[str, Any]:
    """One policy's block of summary.json."""
    scenario = result.scenario
    phases = scenario.phases
    by_tenant: dict[str, list[Attempt]] = defaultdict(list)
    for a in result.attempts:
        by_tenant[a.req.tenant].append(a)

    tenants: dict[str, Any] = {}
    for tenant in scenario.tenants:
        ent = result.config.entitlements[tenant.entitlement or tenant.name]
        slo_ttft = tenant.slo_ttft_s or (
            ent.slo_target_ms / 1000 if ent.slo_target_ms is not None else None
        )
        mine = by_tenant[tenant.name]
        tokens = {p.name: result.output_tokens.get((tenant.name, p.name), 0) for p in phases}
        tenants[tenant.name] = {
            "class": ent.service_class.value,
            "peak_debt": _r(
                max((s.scores.get(tenant.name, (0.0, 0.0))[0] for s in result.samples), default=0.0)
            ),
            "totals": tenant_metrics(
                mine, scenario.duration_s, sum(tokens.values()), slo_ttft, tenant.slo_tpot_s
            ),
            "phases": {
                p.name: tenant_metrics(
                    (a for a in mine if p.start_s <= a.req.sent_at < p.end_s),
                    p.end_s - p.start_s,
                    tokens[p.name],
                    slo_ttft,
                    tenant.slo_tpot_s,
                )
                for p in phases
            },
        }

    samples = result.samples
    waiting_at_end = {}
    utilization = {}
    for p in phases:
        inside = [s for s in samples if p.start_s <= s.t < p.end_s]
        waiting_at_end[p.name] = inside[-1].waiting if inside else 0
        utilization[p.name] = _r(
            sum(s.running / s.slots for s in inside) / len(inside) if inside else 0.0
        )
    block: dict[str, Any] = {
        "tenants": tenants,
        "engine": {
            "max_waiting": max((s.waiting for s in samples), default=0),
            "waiting_at_phase_end": waiting_at_end,
        },
        "utilization": utilization,
        "useful_utilization": useful_utilization(result),
        "fairness": fairness_block(result, DIGITS),
        "gave_up": dict(sorted(result.gave_up.items())),
    }
    if scenario.autoscaling is not None:
        block["replicas"] = {
            "replica_seconds": _r(result.replica_seconds),
            "peak": result.peak_replicas,
            "protected_slo_attainment": _r(slo_attainment(result, protected_only=True)),
        }
    return block


def useful_utilization(result: RunResult) -> dict[str, float | None]:
    """Per phase, the utilisation that went into requests that were not evicted: the busy
    share of the slots less the slot-seconds evicted attempts held inside the phase."""
    interval = result.scenario.sample_interval_s
    evicted = [
        (a.started_at, a.finished_at)
        for a in result.attempts
        if a.outcome == "evicted" and a.started_at is not None and a.finished_at is not None
    ]
    out: dict[str, float | None] = {}
    for p in result.scenario.phases:
        inside = [s for s in result.samples if p.start_s <= s.t < p.end_s]
        if not inside:
            out[p.name] = _r(0.0)
            continue
        busy = sum(s.running / s.slots for s in inside) / len(inside)
        slot_s = sum(s.slots for s in inside) * interval
        wasted = sum(max(0.0, min(end, p.end_s) - max(start, p.start_s)) for start, end in evicted)
        out[p.name] = _r(max(0.0, busy - wasted / slot_s))
    return out


def slo_attainment(result: RunResult, protected_only: bool) -> float | None:
    """Share of the (protected) tenants' requests — jobs, not attempts — that completed
    within the tenant's TTFT SLO; a job refused or evicted for good misses it."""
    jobs = good = 0
    per_tenant = jobs_within_slo(result)
    for tenant in result.scenario.tenants:
        ent = result.config.entitlements[tenant.entitlement or tenant.name]
        if protected_only and not ent.protected:
            continue
        n, met = per_tenant[tenant.name]
        jobs += n
        good += met
    return good / jobs if jobs else None


def summary_json(result: RunResult) -> dict[str, Any]:
    return {
        "scenario": result.scenario.name,
        "seed": result.seed,
        "policies": {result.policy: summarize(result)},
    }
