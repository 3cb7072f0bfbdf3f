"""Turn config into the plain numbers the store's atomic `reserve` compares against.

The capacity rules, per dimension, with C the pool capacity and o = overcommit × C:
- a protected request within its own baseline may fill the pool to C, then (after evicting
  preemptible work) to C + o, and skips the priority threshold: the paper's bounded
  overcommit, reserved for protected classes;
- every other request may fill the pool to C, and its non-preemptible usage plus the unused
  protected baselines may reach at most C in sequences and KV: work that is never evicted
  never sits on a reserved baseline, so a protected tenant coming back finds room by
  evicting preemptible work, not behind work it must wait for. In tokens, the pool bucket
  plus what the lent work in flight would give back when taken back must cover the
  protected share less o × depth, for every such request (state/checks.py): lent work may
  draw on the share as far as it gives it back;
- surplus work (spot, preemptible) also leaves free a share of what the others are expected
  to claim back soon (control/backfill.py); preemptible work may otherwise fill all of C, the
  unused protected baselines included, and is evicted when someone the pool owes capacity
  needs the room (control/eviction.py).
"""

from __future__ import annotations

from tokenpools.control.backfill import BORROWERS
from tokenpools.control.store import INF, BucketSpec, ReservePlan
from tokenpools.model.entitlement import Entitlement
from tokenpools.model.policy import Policy
from tokenpools.model.pool import Pool
from tokenpools.model.service_class import ServiceClass


def pool_bucket(pool: Pool, policy: Policy) -> BucketSpec:
    rate = pool.capacity.throughput
    return BucketSpec(rate, rate * policy.burst_window_s)


def protected_bucket(protected_rate: float, policy: Policy) -> BucketSpec:
    return BucketSpec(protected_rate, protected_rate * policy.burst_window_s)


def own_bucket(ent: Entitlement, policy: Policy) -> BucketSpec:
    """Protected classes: their baseline rate. Others: their burst ceiling, if any."""
    if ent.protected:
        rate = ent.baseline.throughput
    elif ent.burst_ceiling is not None:
        rate = ent.burst_ceiling.throughput
    else:
        rate = INF
    return BucketSpec(rate, rate * policy.burst_window_s)


def claims_once_measured(policy: Policy) -> bool:
    """Whether an owner's claim outlives its first measurement (control/backfill.py). Not
    where taking back suspends: an owner measured is seen as it comes back, and the lent work
    it displaces then is suspended, not lost, so lent work fills what it does not run. Only an
    owner that has just bound, which nobody has measured yet, claims its whole baseline until
    its first update period: its first requests would otherwise queue behind the prefills of
    a flood of lent work admitted at the same moment, on fcfs engines and on priority ones
    alike (a prefill in progress is not preempted; docs/decisions.md, "Lending, and taking
    back", with the measurements)."""
    return not policy.suspend


def reserve_plan(
    pool: Pool, ent: Entitlement, bound: bool, policy: Policy, lent: bool
) -> ReservePlan:
    """`lent`: the plan of requests on lent capacity (control/eviction.py `is_lent`)."""
    cap = pool.capacity
    over = 1.0 + policy.overcommit
    lend = policy.overcommit
    depth = cap.throughput * policy.burst_window_s
    ceiling = ent.burst_ceiling
    if ent.service_class == ServiceClass.GUARANTEED:
        ent_concurrency, ent_kv = ent.baseline.concurrency, ent.baseline.kv_tokens
    elif ceiling is not None:
        ent_concurrency, ent_kv = ceiling.concurrency, ceiling.kv_tokens
    else:
        ent_concurrency = ent_kv = INF
    own_required = ent.service_class == ServiceClass.GUARANTEED or (
        not ent.protected and ceiling is not None and ceiling.throughput < INF
    )
    reserved = ent.protected and bound
    preemptible = lent  # lent work may fill what others are owed; it is taken back
    return ReservePlan(
        ent_concurrency=ent_concurrency,
        ent_kv=ent_kv,
        own_required=own_required,
        base_concurrency=ent.baseline.concurrency if reserved else 0.0,
        base_kv=ent.baseline.kv_tokens if reserved else 0.0,
        reserved_concurrency=cap.concurrency,
        reserved_kv=cap.kv_tokens,
        reserved_bucket_floor=0.0,
        overcommit_concurrency=cap.concurrency * over,
        overcommit_kv=cap.kv_tokens * over,
        overcommit_bucket_floor=-lend * depth,
        shared_concurrency=cap.concurrency,
        shared_kv=cap.kv_tokens,
        nonpreemptible_concurrency=INF if preemptible else cap.concurrency,
        nonpreemptible_kv=INF if preemptible else cap.kv_tokens,
        surplus=ent.service_class in BORROWERS,
        shared_bucket_floor=0.0,
        nonpreemptible_bucket_floor=-lend * depth,
        contended_concurrency=cap.concurrency * (1.0 - policy.headroom),
        contended_kv=cap.kv_tokens * (1.0 - policy.headroom),
        contended_bucket=policy.headroom * depth,
        contention_window_s=policy.contention_window_s,
        priority_margin=1.0 + policy.priority_margin,
    )


def size_limits(
    plan: ReservePlan, own: BucketSpec, pool: BucketSpec, ent: Entitlement, policy: Policy
) -> tuple[float, float]:
    """The largest tokens and KV tokens one request may ever reserve; above either, it is
    rejected at once (it would wait forever). Negative when nothing can ever be admitted."""
    if plan.ent_concurrency < 1 or plan.shared_concurrency < 1:
        return -1.0, -1.0
    over = 1.0 + policy.overcommit if ent.protected else 1.0
    limit = pool.depth * over
    if plan.own_required:
        limit = min(limit, own.depth)
    return limit, min(plan.ent_kv, plan.shared_kv * over)


def fallback_limits(
    ent: Entitlement, own: BucketSpec, fraction: float
) -> tuple[ReservePlan, BucketSpec]:
    """A protected entitlement's budget on one replica while the shared store is unreachable:
    `fraction` of its baseline (at least one sequence), with nothing else to check against."""
    base = ent.baseline
    concurrency = max(1.0, float(int(base.concurrency * fraction))) if base.concurrency else 0.0
    kv = base.kv_tokens * fraction
    plan = ReservePlan(
        ent_concurrency=concurrency,
        ent_kv=kv,
        own_required=True,
        base_concurrency=concurrency,
        base_kv=kv,
        reserved_concurrency=INF,
        reserved_kv=INF,
        reserved_bucket_floor=-INF,
        overcommit_concurrency=INF,
        overcommit_kv=INF,
        overcommit_bucket_floor=-INF,
        shared_concurrency=0.0,  # never reached: within the budget is the reserved path
        shared_kv=0.0,
        nonpreemptible_concurrency=0.0,
        nonpreemptible_kv=0.0,
        surplus=False,
        shared_bucket_floor=INF,
        nonpreemptible_bucket_floor=INF,
        contended_concurrency=INF,
        contended_kv=INF,
        contended_bucket=-INF,
        contention_window_s=0.0,
        priority_margin=1.0,
    )
    return plan, BucketSpec(own.rate * fraction, own.depth * fraction)
