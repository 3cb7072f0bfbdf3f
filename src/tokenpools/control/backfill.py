"""How much of the unused protected baselines surplus work (spot, preemptible) may borrow.

A dedicated or guaranteed baseline that its owner is not using is idle capacity, and the
paper backfills idle capacity with lower classes. But an owner whose load moves up and down
inside its baseline takes that room back within seconds: a preemptible request admitted into
it is evicted before it finishes (its capacity spent, nobody getting the tokens), and a spot
request there, which cannot be evicted, makes the returning owner evict someone else's
preemptible work instead. So surplus work borrows only what each owner has not used lately:
its baseline minus its recent peak in flight. The peak is the most the owner had in flight
in an update period; a quieter period lowers it by baseline × period / `backfill_window_s`,
so capacity an owner has left alone for that long is lent again in full (an idle dedicated
endpoint is backfilled).
`backfill_window_s` = 0 lends all of it, as the paper's work-conserving rule does.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenpools.control.store import INF, Scores
from tokenpools.model.policy import Policy
from tokenpools.model.resources import Resources
from tokenpools.model.service_class import ServiceClass

# The classes that live on surplus, and borrow idle baselines only as far as `lendable` says.
# (Elastic borrows up to the overcommit, plans.py, and is owed its time-averaged baseline.)
BORROWERS = frozenset({ServiceClass.SPOT, ServiceClass.PREEMPTIBLE})


def recent_peaks(
    previous: Scores, period_peak: tuple[float, float], baseline: Resources, policy: Policy
) -> tuple[float, float]:
    """The owner's recent peak (sequences, KV tokens) after one more update period."""
    window = policy.backfill_window_s
    if window <= 0:
        return 0.0, 0.0
    fade = policy.update_period_s / window
    return (
        max(period_peak[0], previous.peak_concurrency - baseline.concurrency * fade, 0.0),
        max(period_peak[1], previous.peak_kv - baseline.kv_tokens * fade, 0.0),
    )


def lendable(owners: Iterable[tuple[Resources, Scores]], policy: Policy) -> tuple[float, float]:
    """What of the bound protected baselines (each with its owner's scores) surplus work may
    fill: Σ max(0, baseline − recent peak), per dimension; INF when lending is not
    limited."""
    if policy.backfill_window_s <= 0:
        return INF, INF
    concurrency = kv = 0.0
    for baseline, scores in owners:
        concurrency += max(0.0, baseline.concurrency - scores.peak_concurrency)
        kv += max(0.0, baseline.kv_tokens - scores.peak_kv)
    return concurrency, kv
