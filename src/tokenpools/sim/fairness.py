"""Fairness as the literature measures it, for every policy's summary (docs/simulation.md):

- VTC's service difference (Sheng et al., OSDI 2024; their artifact's measure): in 60 s windows,
  each tenant's service rate (input + 2 × output tokens of its completed requests, spread evenly
  over each request's decode, first token to last) and its demand rate (the same cost of the
  requests it had pending in the window, sent before the window's end and not finished before
  its start, less what of each was served before the window: unserved demand carries forward,
  so a tenant still waiting on an earlier burst is backlogged); the window's difference is the
  largest, over tenants,
  of min(most served tenant's rate − its own, its demand − its own): how far a tenant that still
  wanted more fell behind the best served. Within each service class, where tenants are meant to
  be treated alike; 0 when nobody who wanted more was behind.
- Jain's index over entitled-share-normalised service: x = tokens served / min(entitlement,
  tokens asked for) per tenant with a baseline, (Σx)² / (n·Σx²); 1 when every tenant got the
  same multiple of what it was entitled to (or asked for, if less).
- SLO attainment per class: the share of a class's jobs (not attempts: a job retried counts
  once) that completed within its tenant's TTFT SLO, TTFT measured from the job's first attempt
  (so waiting out refusals counts against it, as queueing does).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from tokenpools.model.service_class import PROTECTED, ServiceClass
from tokenpools.sim.records import Attempt, RunResult

WINDOW_S = 60.0
STEP_S = 10.0  # window centres this far apart
W_IN, W_OUT = 1.0, 2.0  # VTC's cost of a token


def _cost(prompt: int, output: int) -> float:
    return W_IN * prompt + W_OUT * output


def _classes(result: RunResult) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for t in result.scenario.tenants:
        ent = result.config.entitlements[t.entitlement or t.name]
        groups[ent.service_class.value].append(t.name)
    return dict(groups)


def _decoded(a: Attempt) -> bool:
    """Completed, with its decode known (first token to last): service to spread."""
    return a.outcome == "completed" and a.first_token_at is not None and a.finished_at is not None


def _served(a: Attempt, start: float, end: float) -> float:
    """The part of a completed attempt's cost that falls in [start, end)."""
    assert a.first_token_at is not None and a.finished_at is not None
    first, last = a.first_token_at, a.finished_at
    cost = _cost(a.req.prompt_tokens, a.output_tokens)
    if last <= first:  # one token: all of it at the end
        return cost if start <= last < end else 0.0
    return cost * max(0.0, min(end, last) - max(start, first)) / (last - first)


def window_difference(service: dict[str, float], demand: dict[str, float]) -> float:
    """One window: max over tenants of min(best service − own, own demand − own), at least 0."""
    if len(service) < 2:
        return 0.0
    best = max(service.values())
    return max(0.0, *(min(best - s, demand[t] - s) for t, s in service.items()))


def service_difference(
    result: RunResult, window_s: float = WINDOW_S, step_s: float = STEP_S
) -> dict[str, Any] | None:
    """VTC's service difference per class with at least two tenants, in weighted tokens/s:
    the largest and the mean over windows (and over classes, the worst); None when no class
    has two tenants."""
    duration = result.scenario.duration_s
    window = min(window_s, duration)
    count = int((duration - window) // step_s + 1e-9) + 1  # windows [i·step, i·step + window)
    grouped = {c: n for c, n in _classes(result).items() if len(n) >= 2}
    if not grouped:
        return None
    tenants = {t for names in grouped.values() for t in names}
    service = [dict.fromkeys(tenants, 0.0) for _ in range(count)]
    demand = [dict.fromkeys(tenants, 0.0) for _ in range(count)]

    def centres(first: float, last: float) -> range:
        """The windows that may meet [first, last] (one more on each side costs nothing)."""
        lo = max(0, math.floor((first - window) / step_s))
        hi = min(count - 1, math.ceil(last / step_s))
        return range(lo, hi + 1)

    jobs: dict[int, list[Attempt]] = defaultdict(list)
    for a in result.attempts:
        if a.req.tenant not in tenants:
            continue
        jobs[id(a.job)].append(a)
        if _decoded(a):
            assert a.first_token_at is not None and a.finished_at is not None
            for i in centres(a.first_token_at, a.finished_at):
                service[i][a.req.tenant] += _served(a, i * step_s, i * step_s + window) / window
    for attempts in jobs.values():
        # A job is pending from its first attempt until its last attempt ends (completed, or
        # refused or evicted for good; never, if the run ended first); in every window it is
        # pending in, its tenant demands what of it was not yet served at the window's start.
        tenant = attempts[0].req.tenant
        sent = min(a.req.sent_at for a in attempts)
        ends = [a.finished_at for a in attempts]
        done = math.inf if any(e is None for e in ends) else max(e for e in ends if e is not None)
        done_attempt = next((a for a in attempts if _decoded(a)), None)
        job = attempts[0].job
        if done_attempt is not None:
            cost = _cost(done_attempt.req.prompt_tokens, done_attempt.output_tokens)
        else:
            cost = _cost(job.prompt_tokens, job.output_tokens)
        for i in centres(sent, min(done, duration)):
            start, end = i * step_s, i * step_s + window
            if not (sent < end and done >= start):
                continue
            before = 0.0 if done_attempt is None else _served(done_attempt, -math.inf, start)
            demand[i][tenant] += max(0.0, cost - before) / window
    by_class: dict[str, dict[str, float]] = {}
    for cls, names in grouped.items():
        diffs = [
            window_difference({t: service[i][t] for t in names}, {t: demand[i][t] for t in names})
            for i in range(count)
        ]
        by_class[cls] = {"max": max(diffs), "mean": sum(diffs) / len(diffs)}
    return {
        "max": max(v["max"] for v in by_class.values()),
        "mean": max(v["mean"] for v in by_class.values()),
        "by_class": by_class,
    }


def jain(xs: list[float]) -> float | None:
    squares = sum(x * x for x in xs)
    if len(xs) < 2 or squares <= 0:
        return None
    return sum(xs) ** 2 / (len(xs) * squares)


def entitled_jain_index(result: RunResult) -> float | None:
    """Jain's index of served / min(entitled, asked) over tenants with a throughput baseline,
    in the pool's weighted tokens per second (the unit of the entitlement)."""
    pool = next(iter(result.config.pools.values()))
    w_in, w_out = pool.input_token_weight, pool.output_token_weight
    served: dict[str, float] = defaultdict(float)
    asked: dict[str, float] = defaultdict(float)
    for a in result.attempts:
        if a.outcome == "completed":
            served[a.req.tenant] += w_in * a.req.prompt_tokens + w_out * a.output_tokens
        if a.number == 1:
            asked[a.req.tenant] += w_in * a.job.prompt_tokens + w_out * a.job.output_tokens
    seconds = result.scenario.duration_s
    xs = []
    for t in result.scenario.tenants:
        rate = result.config.entitlements[t.entitlement or t.name].baseline.throughput
        wanted = min(rate, asked[t.name] / seconds)
        if rate > 0 and wanted > 0:
            xs.append(served[t.name] / seconds / wanted)
    return jain(xs)


# Refusals by the entitlement's own limits: the job asked for more than it is entitled to.
OWN_LIMITS = frozenset(
    {"concurrency_limit", "throughput_limit", "kv_limit", "exceeds_entitlement",
     "insufficient_quota"}
)  # fmt: skip


def job_outcomes(result: RunResult) -> dict[str, list[tuple[bool, bool | None]]]:
    """Per tenant, per job: (completed within the tenant's TTFT SLO, counted from the job's
    first attempt to its first token; within its entitlement). A job refused or evicted for
    good misses the SLO; a tenant without an SLO meets it by completing. *Within*: admitted
    within its entitlement's baseline, or refused by the pool while it asked for no more (the
    promise the pool did not keep); not within: admitted above it, or refused by its own
    limits; None where the policy does not say (only tokenpools knows its baselines)."""
    mine: dict[str, list[Attempt]] = defaultdict(list)
    for a in result.attempts:
        mine[a.req.tenant].append(a)
    told = any(a.req.within is not None for a in result.attempts)
    out = {}
    for tenant in result.scenario.tenants:
        ent = result.config.entitlements[tenant.entitlement or tenant.name]
        slo = tenant.slo_ttft_s or (ent.slo_target_ms / 1000 if ent.slo_target_ms else None)
        jobs: dict[int, list[Attempt]] = defaultdict(list)
        for a in mine[tenant.name]:
            jobs[id(a.job)].append(a)
        rows = []
        for attempts in jobs.values():
            # time spent refused and retrying counts, as time queued does under a policy that
            # holds requests instead of refusing them
            first = min(a.req.sent_at for a in attempts)
            met = any(
                a.outcome == "completed"
                and a.first_token_at is not None
                and (slo is None or a.first_token_at - first <= slo)
                for a in attempts
            )
            rows.append((met, asked_within(attempts) if told else None))
        out[tenant.name] = rows
    return out


def asked_within(attempts: list[Attempt]) -> bool:
    """A job starts as excess when its first attempt is refused by the entitlement's own
    limits, or refused while it asked above its baseline (where the policy says so); else it
    is within if admitted within the baseline, or never admitted at all."""
    first = min(attempts, key=lambda a: a.req.sent_at)
    if first.outcome == "rejected" and (first.reason in OWN_LIMITS or first.req.within is False):
        return False
    admitted = [a.req.within for a in attempts if a.outcome != "rejected"]
    return any(admitted) if admitted else True


def jobs_within_slo(result: RunResult) -> dict[str, tuple[int, int]]:
    """Per tenant: (jobs, jobs that completed within the tenant's TTFT SLO)."""
    return {t: (len(rows), sum(m for m, _ in rows)) for t, rows in job_outcomes(result).items()}


def slo_attainment_by_class(result: RunResult) -> dict[str, float | None]:
    per_tenant = jobs_within_slo(result)
    out: dict[str, float | None] = {}
    for cls, names in _classes(result).items():
        jobs = sum(per_tenant[n][0] for n in names)
        good = sum(per_tenant[n][1] for n in names)
        out[cls] = good / jobs if jobs else None
    return out


def slo_attainment_split(result: RunResult) -> dict[str, dict[str, float | None]]:
    """Per protected class, the SLO attainment of jobs within the entitlement and above it
    (none where the policy does not say which is which)."""
    outcomes = job_outcomes(result)
    out: dict[str, dict[str, float | None]] = {}
    for cls, names in _classes(result).items():
        if ServiceClass(cls) not in PROTECTED:
            continue  # only dedicated and guaranteed baselines are promised
        rows = [row for n in names for row in outcomes[n] if row[1] is not None]
        if not rows:
            continue
        split: dict[str, float | None] = {}
        for key, side in (("within", True), ("above", False)):
            part = [met for met, within in rows if within is side]
            split[key] = sum(part) / len(part) if part else None
        out[cls] = split
    return out


def fairness_block(result: RunResult, digits: int = 4) -> dict[str, Any]:
    """The `fairness` block of a policy's summary."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, digits)

    diff = service_difference(result)
    if diff is not None:
        diff = {
            "max": r(diff["max"]),
            "mean": r(diff["mean"]),
            "by_class": {
                c: {"max": r(v["max"]), "mean": r(v["mean"])} for c, v in diff["by_class"].items()
            },
        }
    return {
        "vtc_service_difference": diff,
        "jain_index": r(entitled_jain_index(result)),
        "slo_attainment": {c: r(v) for c, v in slo_attainment_by_class(result).items()},
        "slo_attainment_split": {
            c: {k: r(v) for k, v in split.items()}
            for c, split in slo_attainment_split(result).items()
        },
    }
