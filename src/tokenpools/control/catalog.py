"""The catalog: what is configured and how it is bound, as views the admission path reads.

Config in, per pool and per entitlement out: binding state (the core's own, or one decided
outside), reserve plan, size limits, priority; each change pushed to the store.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable
from dataclasses import replace

from tokenpools.control import plans
from tokenpools.control.backfill import BORROWERS, first_claim, rescaled
from tokenpools.control.binding import bind, external_states
from tokenpools.control.budgets import Budgets
from tokenpools.control.eviction import is_lent, may_evict, turn
from tokenpools.control.priority import priority, slo_reference
from tokenpools.control.store import Lease, Scores, Store, StoreUnavailable
from tokenpools.control.views import EntitlementView, PoolView
from tokenpools.model.config import Config
from tokenpools.model.entitlement import BindingState, Entitlement
from tokenpools.model.policy import Policy
from tokenpools.model.pool import Pool
from tokenpools.model.service_class import ServiceClass


class Catalog:
    """What is configured and how it is bound: a view per pool and per entitlement (with its
    reserve plan and priority), and the binding bookkeeping."""

    def __init__(self, store: Store, config: Config, now: float, suspends: bool = False) -> None:
        self.store = store
        self._host_suspends = suspends
        self._pools: dict[str, PoolView] = {}
        self._ents: dict[str, EntitlementView] = {}
        self._since: dict[str, int] = {}  # when each entitlement last bound or started waiting
        self._transitions = itertools.count()
        self._next_expiry = math.inf  # earliest expiresAt of an entitlement not yet Expired
        self.config = config
        self.policy = self._policy(config)
        self.apply_config(config, now)

    # -- configuration -------------------------------------------------------------------

    def apply_config(self, config: Config, now: float) -> tuple[Lease, ...]:
        """Adopt a new config, keeping the state of entitlements that remain. Returns the
        leases of removed entitlements: the host must end those requests."""
        self.config = config
        self.policy = self._policy(config)
        self.budgets = Budgets(config)
        ended: list[Lease] = []
        for name, view in list(self._ents.items()):
            new = config.entitlements.get(name)
            if new is None or new.pool != view.ent.pool:  # gone, or moved: start afresh
                with contextlib.suppress(StoreUnavailable):  # its leases then expire there
                    ended += self.store.remove_entitlement(name, now)
                del self._ents[name]
                self._since.pop(name, None)
        pools: dict[str, PoolView] = {}
        for name, pool in config.pools.items():
            old = self._pools.get(name)
            if old is not None:  # keep the capacity the autoscaler or a host set
                replicas = max(pool.min_replicas, min(pool.max_replicas, old.pool.replicas))
                pool = pool.with_replicas(replicas)
                if old.per_replica_override is not None:
                    pool = replace(pool, per_replica=old.per_replica_override)
            pools[name] = PoolView(
                pool=pool,
                bucket=plans.pool_bucket(pool, self.policy),
                slo_reference_ms=0.0,
                mean_service_s=old.mean_service_s if old else self._service_guess(pool),
                members=[e.name for e in config.entitlements.values() if e.pool == name],
                last_period=old.last_period if old else -1,
                typical_output=old.typical_output if old else 0.0,
                claim_scale=old.claim_scale if old else 1.0,
                per_replica_override=old.per_replica_override if old else None,
            )
        self._pools = pools
        self.rebind(now)
        return tuple(ended)

    @staticmethod
    def _service_guess(pool: Pool) -> float:
        # Until a lease has ended: the time one sequence needs for 512 tokens at its fair share.
        cap = pool.capacity
        per_sequence = cap.throughput / cap.concurrency if cap.concurrency > 0 else 0.0
        return 512.0 / per_sequence if per_sequence > 0 else 10.0

    def rebind(self, now: float) -> dict[str, BindingState]:
        """Re-run binding for every pool and push the resulting plans to the store."""
        changed: dict[str, BindingState] = {}
        policy = self.policy
        for view in self._pools.values():
            pool = view.pool
            members = [self.config.entitlements[n] for n in view.members]
            previous = {n: self._ents[n].state for n in view.members if n in self._ents}
            if self.config.bindings is None:
                states = bind(pool, members, previous, policy, now, self._since)
            else:
                states = external_states(members, self.config.bindings, now)
            for name, state in states.items():  # in the order binding placed them
                was_bound = previous.get(name) == BindingState.BOUND
                if name not in self._since or was_bound != (state == BindingState.BOUND):
                    self._since[name] = next(self._transitions)
            protected_rate = sum(
                e.baseline.throughput
                for e in members
                if e.protected and states[e.name] == BindingState.BOUND
            )
            self.store.configure_pool(
                pool.name, view.bucket, plans.protected_bucket(protected_rate, policy), now
            )
            view.slo_reference_ms = slo_reference(
                pool.slo_reference_ms,
                (e.slo_target_ms for e in members if states[e.name] == BindingState.BOUND),
            )
            for ent in members:
                state = states[ent.name]
                if previous.get(ent.name) != state:
                    changed[ent.name] = state
                bound = state == BindingState.BOUND
                own = plans.own_bucket(ent, policy)
                reserved = ent.protected and bound
                self.store.configure_entitlement(
                    ent.name,
                    pool.name,
                    own,
                    ent.baseline.concurrency if reserved else 0.0,
                    ent.baseline.kv_tokens if reserved else 0.0,
                    now,
                    protected=reserved,
                )
                if bound and previous.get(ent.name) != BindingState.BOUND:
                    self._claim_baseline(ent, now, rebound=ent.name in previous)
                lent = is_lent(ent.service_class, policy)
                plan = plans.reserve_plan(pool, ent, bound, policy, lent)
                # the plan of a lent class's request the host cannot take back (gatekeeper.py)
                kept = lent
                limit_tokens, limit_kv = plans.size_limits(plan, own, view.bucket, ent, policy)
                self._ents[ent.name] = EntitlementView(
                    ent=ent,
                    state=state,
                    plan=plan,
                    own_bucket=own,
                    preemptible=lent,
                    protected=ent.protected,
                    default_max_tokens=ent.default_max_tokens or policy.default_max_tokens,
                    size_limit_tokens=limit_tokens,
                    size_limit_kv=limit_kv,
                    kept_plan=plans.reserve_plan(pool, ent, bound, policy, False) if kept else None,
                    suspendable=policy.suspend
                    and (lent or ent.service_class is ServiceClass.ELASTIC),
                )
                self._refresh_priority(ent.name, now)
            self.arrange_surplus(view)
        self._next_expiry = min(
            (
                v.ent.expires_at
                for v in self._ents.values()
                if v.ent.expires_at is not None and v.state != BindingState.EXPIRED
            ),
            default=math.inf,
        )
        return changed

    def _policy(self, config: Config) -> Policy:
        """The config's policy, suspension off where the host cannot suspend."""
        policy = config.policy
        return (
            policy if self._host_suspends or not policy.suspend else replace(policy, suspend=False)
        )

    def arrange_surplus(self, view: PoolView) -> None:
        """From the members' latest scores: the order preemptible entitlements are evicted in
        (lowest priority first; equal ones take turns, control/eviction.py `turn`)."""
        period = view.last_period
        evictable = sorted(
            (self._ents[n] for n in view.members if self._ents[n].preemptible),
            key=lambda m: (m.priority, turn(period, m.ent.name), m.ent.name),
        )
        view.preemptible_order = [m.ent.name for m in evictable]
        view.preemptible_priorities = [m.priority for m in evictable]

    def _claim_baseline(self, ent: Entitlement, now: float, rebound: bool) -> None:
        """An entitlement that has just bound claims its whole baseline until measured. One
        this process sees for the first time (it has just started, or the entitlement was
        added) keeps what the store holds of it, if anything: a gateway restarted on a shared
        store must not take back what the others measured (docs/decisions.md, "A restart")."""
        if ent.service_class in BORROWERS:
            return
        with contextlib.suppress(StoreUnavailable):  # claimed at the next update instead
            old = self.store.scores(ent.name, now)
            if not rebound and old != Scores():
                return
            claim_c, claim_k = first_claim(ent.baseline, old, self.policy)
            if (claim_c, claim_k) != (old.peak_concurrency, old.peak_kv):
                self.store.set_scores(
                    ent.name, replace(old, peak_concurrency=claim_c, peak_kv=claim_k), now
                )

    def note_evicted(self, leases: Iterable[Lease]) -> None:
        """Preemptible leases were evicted: surplus work in their pools leaves more free."""
        for lease in leases:
            view = self._pools.get(lease.pool)
            if view is not None:
                view.claim_scale = rescaled(view.claim_scale, True, self.policy)

    def adopt_scores(self, view: EntitlementView, scores: Scores) -> float:
        """Take an entitlement's scores; its priority computed from them is returned."""
        view.priority = w = self._priority_of(view, scores)
        view.scores = replace(scores, priority=w)
        view.may_evict = may_evict(view.ent.service_class, scores.debt)
        return w

    def _priority_of(self, view: EntitlementView, scores: Scores) -> float:
        ent = view.ent
        return priority(
            ent.service_class,
            ent.slo_target_ms,
            self._pools[ent.pool].slo_reference_ms,
            scores.burst,
            scores.debt,
            self.policy,
        )

    def _refresh_priority(self, name: str, now: float) -> None:
        view = self._ents[name]
        try:
            scores = self.store.scores(name, now)
        except StoreUnavailable:
            scores = view.scores
        w = self.adopt_scores(view, scores)
        if w != scores.priority:
            with contextlib.suppress(StoreUnavailable):
                self.store.set_scores(name, replace(scores, priority=w), now)

    # -- lookups -------------------------------------------------------------------------

    @property
    def next_expiry(self) -> float:
        """The earliest expiresAt of an entitlement not yet Expired (inf: none)."""
        return self._next_expiry

    @property
    def entitlements(self) -> dict[str, EntitlementView]:
        return self._ents

    @property
    def pools(self) -> dict[str, PoolView]:
        return self._pools
