"""What surplus work (spot, preemptible) may fill: capacity nobody is expected to claim back
before it finishes (docs/decisions.md, "Preemptible work that completes").

Every bound entitlement above the surplus classes (dedicated, guaranteed, elastic) holds a
*claim*: the number of sequences (and KV tokens) it is expected to come back to soon. It is
its recent peak in flight, fading with time constant `backfill_window_s` towards its mean in
flight plus two Poisson standard deviations (what an owner at that mean reaches in a burst),
never above what the entitlement may ever hold, and its whole baseline while it has just
(re)bound and nothing has been measured yet. What is open of a claim, max(0, claim − in
flight), is what its owner may take back soon. Owners take it back independently: the store
keeps per pool Σ open and Σ open², and counts open claims as min(Σ open, 2 √(Σ open²)) — their
plain sum for up to four owners, growing as √n beyond (fifty owners do not all peak at
once). A surplus request must leave `share` of that free, in the same atomic step as the
capacity checks (state/checks.py, state/redis/lua/reserve.lua).

`share` grows with how long the request is expected to run (its output tokens against the
pool's typical request: what an owner takes back within a short request's life is less than
within a long one's), times the pool's scale, learnt from how its preemptible work fares:
every eviction of a preemptible request (to admit someone, or on a capacity loss) raises it,
every completion lowers it, so that it settles where `preemptible_completion_target` of the
admitted ones complete; a raised scale fades back with the claims' time constant. Spot work
leaves the same share free: what is safe for preemptible work is safe for spot, and spot,
which outranks it, must not be held back further than it.

`backfill_window_s` = 0 claims nothing: surplus work fills every idle baseline, as the
paper's work-conserving rule does.
"""

from __future__ import annotations

import math

from tokenpools.control.store import Scores
from tokenpools.model.policy import Policy
from tokenpools.model.resources import Resources
from tokenpools.model.service_class import ServiceClass

# The classes that live on surplus and must leave the others' claims free.
BORROWERS = frozenset({ServiceClass.SPOT, ServiceClass.PREEMPTIBLE})

SPREAD_SIGMAS = 2.0  # a claim fades towards mean + this many √mean (Poisson in flight)
MAX_LENGTH_SHARE = 1.5  # a long request leaves at most this multiple of the claims free
SCALE_RANGE = (0.25, 4.0)  # a pool's scale stays within this
SCALE_STEP = 0.25  # log-scale step per eviction (× target) and per completion (× 1 − target)
OUTPUT_EWMA = 0.05  # weight of each settled request in the pool's typical output


def next_claim(
    previous: Scores,
    period_peak: tuple[float, float],
    period_mean: tuple[float, float],
    limit: tuple[float, float],
    policy: Policy,
) -> tuple[float, float]:
    """An entitlement's claim (sequences, KV tokens) after one more update period."""
    window = policy.backfill_window_s
    if window <= 0:
        return 0.0, 0.0
    keep = math.exp(-policy.update_period_s / window)
    mean_c, mean_k = period_mean
    spread = 1.0 + SPREAD_SIGMAS / math.sqrt(mean_c) if mean_c > 0 else 1.0
    out = []
    for prev, peak, mean, cap in zip(
        (previous.peak_concurrency, previous.peak_kv),
        period_peak,
        (mean_c, mean_k),
        limit,
        strict=True,
    ):
        target = mean * spread
        faded = target + (prev - target) * keep
        out.append(min(cap, max(peak, faded, 0.0)))
    return out[0], out[1]


def first_claim(baseline: Resources, previous: Scores, policy: Policy) -> tuple[float, float]:
    """The claim of an entitlement that has just bound: its whole baseline until measured."""
    if policy.backfill_window_s <= 0:
        return 0.0, 0.0
    return (
        max(previous.peak_concurrency, baseline.concurrency),
        max(previous.peak_kv, baseline.kv_tokens),
    )


def open_claims(total: float, squares: float) -> float:
    """What owners may take back soon, from Σ open and Σ open² of their claims."""
    return min(total, SPREAD_SIGMAS * math.sqrt(max(0.0, squares)))


def slots_kept(share: float, total: float, squares: float) -> float:
    """The sequences a surplus request leaves free: whole ones, so a fraction of one (a
    claim fading out) holds no slot back."""
    return math.floor(share * open_claims(total, squares) + 1e-9)


def kv_kept(share: float, total: float, squares: float) -> float:
    """The KV tokens a surplus request leaves free."""
    return share * open_claims(total, squares)


def claim_share(output_tokens: float, typical_output: float, scale: float) -> float:
    """The part of the pool's open claims a surplus request must leave free."""
    if typical_output <= 0:  # nothing measured yet: as a typical request
        return scale
    return min(MAX_LENGTH_SHARE, output_tokens / typical_output) * scale


def rescaled(scale: float, evicted: bool, policy: Policy) -> float:
    """A pool's scale after one of its preemptible requests ended."""
    target = policy.preemptible_completion_target
    step = SCALE_STEP * target if evicted else -SCALE_STEP * (1.0 - target)
    low, high = SCALE_RANGE
    return max(low, min(high, scale * math.exp(step)))


def forgotten(scale: float, policy: Policy) -> float:
    """A scale after one more update period. Raised, it fades back to 1 with the claims'
    time constant: a tenant held back admits little, so completions could never lower it
    again, and old evictions (a capacity loss) would shut it out for good. Lowered, it stays:
    the completions that lowered it keep coming while it admits."""
    if policy.backfill_window_s <= 0 or scale <= 1.0:
        return scale
    keep = math.exp(-policy.update_period_s / policy.backfill_window_s)
    return math.exp(math.log(scale) * keep)


def typical_output(previous: float, output_tokens: float) -> float:
    """The pool's typical output per request after one more settled request."""
    if previous <= 0:
        return float(output_tokens)
    return previous + OUTPUT_EWMA * (output_tokens - previous)
