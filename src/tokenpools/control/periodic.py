"""Time and capacity, the core's other events: the tick (lost leases expire, entitlements
expire, and once per update period — once per pool across every replica sharing the store —
debt, burst and priority are updated from the usage windows), capacity changes (replicas added
or lost, preemptible leases evicted until the rest fits) and the autoscaling rule's ask."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tokenpools.control import plans
from tokenpools.control.autoscale import capacity_need, desired_replicas
from tokenpools.control.backfill import BORROWERS, forgotten, next_claim
from tokenpools.control.catalog import Catalog
from tokenpools.control.decisions import CapacityChange, TickResult
from tokenpools.control.eviction import elastic_to_take_back, overdrawn, until_fits
from tokenpools.control.fallback import LocalFallback
from tokenpools.control.observation import Observation, burst_excess, ewma, observe, service_gap
from tokenpools.control.store import Lease, Scores, Store, StoreUnavailable
from tokenpools.control.views import EntitlementView, PoolView
from tokenpools.model.entitlement import BindingState, Entitlement
from tokenpools.model.resources import Resources
from tokenpools.model.service_class import ServiceClass


class Periodic:
    """The core's collaborator for time and capacity: it updates the catalog's views (bound
    states, scores, the order surplus work is evicted in) and the store (usage windows read,
    scores written, leases expired or evicted)."""

    def __init__(self, catalog: Catalog, store: Store, fallback: LocalFallback) -> None:
        self.catalog, self.store, self.fallback = catalog, store, fallback
        self.observations: dict[str, Observation] = {}  # each entitlement's, last period

    def tick(self, now: float) -> TickResult:
        """Expire lost leases and expired entitlements; once per update period (once per pool
        across every replica sharing the store) update debt, burst and priority."""
        expired = tuple(self.fallback.expire(now))
        states: dict[str, BindingState] = {}
        if now >= self.catalog.next_expiry:
            states = self.catalog.rebind(now)
        try:
            if self.fallback.leases and self.fallback.hand_over_on_tick:
                self.fallback.hand_over(self.store, now)
            expired += tuple(self.store.expire(now))
            updated = self._update_pools(now)
        except StoreUnavailable:
            updated = []
        return TickResult(expired, tuple(updated), states)

    def _update_pools(self, now: float) -> list[str]:
        period = int(now // self.catalog.policy.update_period_s)
        updated = []
        for name, pool_view in self.catalog.pools.items():
            if period > pool_view.last_period:
                pool_view.last_period = period
                pool_view.claim_scale = forgotten(pool_view.claim_scale, self.catalog.policy)
                if self.store.claim_update(name, period, now):
                    self._update_scores(pool_view, now)
                    updated.append(name)
                    self.catalog.arrange_surplus(pool_view)
                else:  # another replica updates them: read them once it has, next tick
                    pool_view.scores_pending = True
            elif pool_view.scores_pending:
                pool_view.scores_pending = False
                ents = self.catalog.entitlements
                for member in pool_view.members:
                    self.catalog.adopt_scores(ents[member], self.store.scores(member, now))
                self.catalog.arrange_surplus(pool_view)
        return updated

    def _update_scores(self, pool_view: PoolView, now: float) -> None:
        policy = self.catalog.policy
        for name in pool_view.members:
            view = self.catalog.entitlements[name]
            ent = view.ent
            window = self.store.take_window(name, now)
            obs = self.observations[name] = observe(window)
            old = self.store.scores(name, now)
            bound = view.state == BindingState.BOUND
            debt = (
                ewma(old.debt, service_gap(ent.baseline.throughput, obs), policy.gamma_debt)
                if ent.accrues_debt and bound
                else 0.0
            )
            burst = ewma(old.burst, burst_excess(ent.baseline, obs), policy.gamma_burst)
            claim_c, claim_k = (
                next_claim(
                    old,
                    (window.peak_concurrency, window.peak_kv),
                    (obs.usage.concurrency, obs.usage.kv_tokens),
                    (view.plan.ent_concurrency, view.plan.ent_kv),
                    policy,
                )
                if self._claims(view) and plans.claims_once_measured(policy)
                else (0.0, 0.0)
            )
            self.catalog.adopt_scores(view, Scores(debt, burst, 0.0, claim_c, claim_k))
            self.store.set_scores(name, view.scores, now)

    @staticmethod
    def _claims(view: EntitlementView) -> bool:
        return view.state == BindingState.BOUND and view.ent.service_class not in BORROWERS

    def set_replicas(self, pool_name: str, replicas: int, now: float) -> CapacityChange:
        return self.set_capacity(pool_name, now, replicas=replicas)

    def set_capacity(
        self,
        pool_name: str,
        now: float,
        replicas: int | None = None,
        per_replica: Resources | None = None,
    ) -> CapacityChange:
        """Apply a capacity change at once (replicas added or lost, or replicas that lost part
        of their capacity): admissions use the new capacity from now on, and preemptible
        leases are evicted (lowest priority, newest first) until what remains fits. Where the
        host suspends, elastic work that now leaves too little room beside the baselines of
        the owners with work in flight is taken back too (suspended). Other work above the new
        capacity runs to its end; nothing new is admitted meanwhile."""
        view = self.catalog.pools[pool_name]
        if replicas is not None:
            view.pool = view.pool.with_replicas(replicas)
        if per_replica is not None:
            if not per_replica.is_nonnegative():
                raise ValueError(f"pool {pool_name!r}: capacity must be >= 0, got {per_replica}")
            view.pool = replace(view.pool, per_replica=per_replica)
            view.per_replica_override = per_replica
        view.bucket = plans.pool_bucket(view.pool, self.catalog.policy)
        states = self.catalog.rebind(now)
        cap = view.pool.capacity
        evicted: list[Lease] = []  # preemptible work, what surplus work learns from
        taken: list[Lease] = []  # elastic work, taken back for owners
        try:  # unreachable store: admissions already use the new capacity; nothing evicted
            counters = self.store.pool_counters(pool_name, now)
            over = (counters.concurrency - cap.concurrency, counters.kv_tokens - cap.kv_tokens)
            groups = self.store.preemptible_leases(pool_name, now)
            for lease in until_fits(over, groups, view.preemptible_order)[0]:
                self.store.take_back(lease.lease_id, now)
                evicted.append(lease)
            if self.catalog.policy.suspend:
                for lease in self._taken_back_for_owners(view, now):
                    self.store.take_back(lease.lease_id, now)
                    taken.append(lease)
        except StoreUnavailable:
            pass
        self.catalog.note_evicted(evicted)
        return CapacityChange((*evicted, *taken), states)

    def _taken_back_for_owners(self, view: PoolView, now: float) -> list[Lease]:
        """Elastic work to take back now that the pool has less capacity, so that the
        baselines of the protected owners with work in flight fit beside the work that is not
        lent (control/eviction.py `elastic_to_take_back`). An owner with nothing in flight is not
        counted: taking work back for one that may not come back would only make that work
        wait for nothing; with none active, nothing is taken."""
        ents = self.catalog.entitlements
        members = [ents[name] for name in view.members]
        active, held_c, held_k = False, 0.0, 0.0
        for m in members:
            if m.protected and m.state == BindingState.BOUND:
                mine = self.store.entitlement_counters(m.ent.name, now)
                if mine.leases:
                    active = True
                    held_c += max(0.0, m.ent.baseline.concurrency - mine.concurrency)
                    held_k += max(0.0, m.ent.baseline.kv_tokens - mine.kv_tokens)
        if not active:
            return []
        counters = self.store.pool_counters(view.pool.name, now)
        over = overdrawn(counters, view.pool.capacity, (held_c, held_k))
        if over[0] <= 0 and over[1] <= 0:
            return []
        elastic = sorted(
            (m for m in members if m.ent.service_class is ServiceClass.ELASTIC),
            key=lambda m: (m.priority, m.ent.name),
        )
        groups = self.store.resumable_leases(view.pool.name, now)
        return elastic_to_take_back(over, groups, [m.ent.name for m in elastic])

    def desired_replicas(self, pool_name: str) -> int:
        view, ents = self.catalog.pools[pool_name], self.catalog.entitlements
        members: Sequence[Entitlement] = [
            ents[n].ent for n in view.members if ents[n].state != BindingState.EXPIRED
        ]
        return desired_replicas(view.pool, capacity_need(members, self.observations))
