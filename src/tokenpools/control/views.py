"""The views the admission path reads, one per pool and per entitlement: config-derived data
and caches, kept by the catalog (catalog.py) and read by every rule. Apart from the catalog
so that the decisions' types (decisions.py) read them without importing the catalog, which
imports the budgets, which import the decisions."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenpools.control.store import BucketSpec, ReservePlan, Scores
from tokenpools.model.entitlement import BindingState, Entitlement
from tokenpools.model.pool import Pool
from tokenpools.model.resources import Resources

__all__ = ["EntitlementView", "PoolView"]


@dataclass(slots=True)
class EntitlementView:
    """Config-derived data of one entitlement, cached for the admission path."""

    ent: Entitlement
    state: BindingState
    plan: ReservePlan  # its requests' (lent ones', if its class is lent)
    own_bucket: BucketSpec
    preemptible: bool  # its class is lent (control/eviction.py `is_lent`)
    protected: bool  # dedicated or guaranteed: may overcommit past a full pool
    default_max_tokens: int
    # the size limit: a request whose weighted tokens or KV exceed it can never be admitted
    size_limit_tokens: float
    size_limit_kv: float
    priority: float = 0.0
    scores: Scores = field(default_factory=Scores)  # the latest, priority included
    may_evict: bool = False  # control/eviction.py, from the class and the debt
    # the plan of a request of a lent class that the host cannot resume: not lent (None: the
    # class is not lent, or preemptible, whose requests are lent whatever ends them)
    kept_plan: ReservePlan | None = None
    # its requests the host can resume are suspended when taken back, where the host suspends:
    # lent work, and elastic work after a capacity loss (control/eviction.py
    # `elastic_to_take_back`)
    suspendable: bool = False


@dataclass(slots=True)
class PoolView:
    pool: Pool
    bucket: BucketSpec
    slo_reference_ms: float
    mean_service_s: float  # EWMA of lease durations, for Retry-After
    members: list[str]
    typical_output: float = 0.0  # EWMA of settled requests' output tokens (0: none yet)
    # how much of the open claims surplus work leaves free, learnt from how the pool's
    # preemptible requests ended here (control/backfill.py)
    claim_scale: float = 1.0
    last_period: int = -1
    scores_pending: bool = False  # another replica's update of this period is not read yet
    preemptible_order: list[str] = field(default_factory=list)  # by priority, lowest first
    preemptible_priorities: list[float] = field(default_factory=list)  # theirs, same order
    per_replica_override: Resources | None = None  # set by set_capacity; outlives reloads
