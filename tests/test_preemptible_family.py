"""The preemptible family (sim/family.py): generated pools of 1–4 replicas with protected,
elastic, spot and preemptible tenants, bursts and capacity drops. On a slice of it, every rule
of docs/decisions.md, "Preemptible work that completes" must hold at once: what preemptible
work is admitted mostly completes, and the protected tenants keep their TTFT SLO wherever they
stay within their baselines. The whole family, against the code before, is
benchmarks/preemptible_family.py."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenpools.sim.family import family_scenario, protected_phases
from tokenpools.sim.family_eval import MIN_ADMITTED, MemberRun, aggregate, run_family

SLICE = range(0, 16)
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def runs() -> list[MemberRun]:
    return run_family(SLICE, SEEDS, ["tokenpools"])


def test_preemptible_work_admitted_mostly_completes_in_every_member(runs: list[MemberRun]) -> None:
    judged = [r for r in runs if r.judged]
    assert len(judged) >= len(runs) // 2  # the bar is tested, not skipped
    low = [
        (r.index, r.seed, r.completed, r.ended) for r in judged if r.completed_per_admitted < 0.5
    ]
    assert low == []
    assert aggregate(runs)["completed_per_admitted"] >= 0.85


def test_protected_tenants_keep_their_slo_where_they_stay_within_their_baselines(
    runs: list[MemberRun],
) -> None:
    summary = aggregate(runs)
    assert summary["promised_phases"] >= 100
    assert summary["promised_met_share"] >= 0.95


def test_useful_utilisation_is_the_busy_share_less_what_evictions_threw_away(
    runs: list[MemberRun],
) -> None:
    for r in runs:
        assert 0 <= r.useful_utilization <= r.utilization <= 1
        if r.wasted_slot_s == 0:
            assert r.useful_utilization == pytest.approx(r.utilization, abs=1e-3)
    # taking back suspends: lent work is kept, so nothing is thrown away and all of the busy
    # share is useful (an evicting policy's waste: tests/test_llmd_flow.py)
    assert sum(r.suspensions for r in runs) > 0
    assert all(r.thrown_away_tokens == 0 and r.wasted_slot_s == 0 for r in runs)


def test_the_family_covers_what_it_promises_and_is_the_same_every_time() -> None:
    members = [family_scenario(i) for i in range(60)]
    assert family_scenario(7) == members[7]
    replicas = Counter(m.engine.replicas for m in members)
    assert set(replicas) == {1, 2, 3, 4}
    kinds = {t.workload.arrivals.kind for m in members for t in m.tenants}
    assert kinds == {"poisson", "gamma", "closed"}
    assert sum(bool(m.capacity) for m in members) >= 15
    assert sum(any(t.name == "scrape" for t in m.tenants) for m in members) >= 30
    assert sum(any(t.changes for t in m.tenants) for m in members) >= 10  # bursts
    classes = {e["serviceClass"] for m in members for e in m.tokenpools["entitlements"]}
    assert classes == {"dedicated", "guaranteed", "elastic", "spot", "preemptible"}
    promised = [p for m in members for p in protected_phases(m)]
    assert any(p.within_baseline for p in promised) and not all(p.within_baseline for p in promised)
    assert MIN_ADMITTED == 20
