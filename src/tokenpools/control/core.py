"""The decision core: every host (gateway, simulator, emulator, operator) calls this.

Hosts feed it events — a request arrives, a request ends, time passes, capacity changes,
config changes — and act on the values it returns. It keeps only config-derived data and
caches; everything that changes per request lives in the store.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

from tokenpools.control import plans
from tokenpools.control.autoscale import capacity_need, desired_replicas
from tokenpools.control.catalog import Catalog, EntitlementView, PoolView
from tokenpools.control.decisions import (
    SHORTFALL_REJECTS,
    STATE_REASONS,
    Admit,
    CapacityChange,
    Check,
    Decision,
    Reason,
    Reject,
    TickResult,
)
from tokenpools.control.fallback import LocalFallback
from tokenpools.control.ledger import Observation, burst_excess, ewma, observe, service_gap
from tokenpools.control.retry import expected_wait_s, jittered
from tokenpools.model.config import Config
from tokenpools.model.entitlement import BindingState, Entitlement
from tokenpools.model.request import RequestCost, Usage
from tokenpools.model.resources import Resources
from tokenpools.state.base import (
    EntitlementCounters,
    Lease,
    PoolCounters,
    Scores,
    Shortfall,
    Store,
    StoreUnavailable,
)
from tokenpools.state.memory import MemoryStore

# The shortfalls a protected request's overcommit can cover (its path has no reserved checks).
_POOL_SHORTFALLS = frozenset(
    {Shortfall.POOL_CONCURRENCY, Shortfall.POOL_KV, Shortfall.POOL_THROUGHPUT}
)
_ENTITLEMENT_SHORTFALLS = frozenset(
    {
        Shortfall.ENTITLEMENT_CONCURRENCY,
        Shortfall.ENTITLEMENT_THROUGHPUT,
        Shortfall.ENTITLEMENT_KV,
    }
)
_NO_COUNTERS = EntitlementCounters(0.0, 0.0, 0.0, 0)  # for waits that do not read them


class DecisionCore(Catalog):
    """The decisions on requests and time: admission, the ends of requests, the periodic
    update and capacity changes, over the configured and bound views of `Catalog`."""

    def __init__(
        self, config: Config, store: Store | None = None, now: float = 0.0, replica: str = "r0"
    ) -> None:
        self._replica = replica
        self._seq = itertools.count(1)
        self.observations: dict[str, Observation] = {}
        self.fallback = LocalFallback(config.state.fallback_fraction, config.state.retry_interval_s)
        super().__init__(MemoryStore() if store is None else store, config, now)

    def apply_config(self, config: Config, now: float) -> tuple[Lease, ...]:
        """Adopt a new config, keeping the state of entitlements that remain. Returns the
        leases of removed entitlements: the host must end those requests."""
        self.fallback.fraction = config.state.fallback_fraction
        self.fallback.retry_after_s = config.state.retry_interval_s
        return super().apply_config(config, now)

    # -- admission -----------------------------------------------------------------------

    def admit(
        self, entitlement: str, cost: RequestCost, now: float, request_id: str | None = None
    ) -> Decision:
        view = self._ents.get(entitlement)
        if view is None:
            return Reject(
                Reason.UNKNOWN_ENTITLEMENT, Check.STATE, f"unknown entitlement {entitlement!r}"
            )
        ent = view.ent
        if view.state != BindingState.BOUND or (
            ent.expires_at is not None and now >= ent.expires_at
        ):
            if view.state == BindingState.BOUND:  # expired since the last tick
                self._rebind(now)
            reason = STATE_REASONS[self._ents[entitlement].state]
            return Reject(reason, Check.STATE, f"entitlement {entitlement!r} is not bound")

        pool_view = self._pools[ent.pool]
        pool = pool_view.pool
        max_out = cost.max_output_tokens or view.default_max_tokens  # paper check 2
        tokens = pool.input_token_weight * cost.input_tokens + pool.output_token_weight * max_out
        kv = float(cost.input_tokens + max_out)
        store = self.store
        if tokens > view.max_tokens or kv > view.max_kv:
            # Not counted as demand: no capacity could ever serve it, so it is owed nothing.
            return self._too_big(view, pool_view, tokens, kv)

        lease_id = f"{self._replica}-{next(self._seq)}" if request_id is None else request_id
        lease = Lease(
            lease_id,
            pool.name,
            entitlement,
            tokens,
            kv,
            now,
            now + self.policy.lease_ttl_s,
            view.preemptible,
        )
        try:
            if request_id is not None and store.get_lease(request_id) is not None:
                raise ValueError(f"request id {request_id!r} already holds a lease")
            return self._reserve(view, pool_view, lease, tokens, kv, now)
        except StoreUnavailable:
            if request_id is not None and request_id in self.fallback.leases:
                raise ValueError(f"request id {request_id!r} already holds a lease") from None
            return self.fallback.admit(ent, view.own_bucket, view.priority, lease, now)

    def _reserve(
        self,
        view: EntitlementView,
        pool_view: PoolView,
        lease: Lease,
        tokens: float,
        kv: float,
        now: float,
    ) -> Decision:
        store = self.store
        plan = view.plan
        pool = pool_view.pool.name
        short = store.reserve(lease, plan, now, demand=tokens)
        if short is None:
            return Admit(lease, view.priority)
        counters = store.pool_counters(pool, now)
        if short in (Shortfall.POOL_CONCURRENCY, Shortfall.POOL_KV):
            victims = self._choose_victims(view, pool_view, counters, kv)
            if (
                victims
                and store.reserve(lease, plan, now, evict=[v.lease_id for v in victims]) is None
            ):
                return Admit(lease, view.priority, evict=tuple(victims))
        if (
            view.ent.protected
            and short in _POOL_SHORTFALLS
            and store.reserve(lease, plan, now, overcommit=True) is None
        ):
            return Admit(lease, view.priority, overcommit=True)
        return self._reject(short, view, pool_view, counters, tokens, kv, lease.lease_id, now)

    def _too_big(
        self, view: EntitlementView, pool_view: PoolView, tokens: float, kv: float
    ) -> Reject:
        plan = view.plan
        needs = f"request needs {tokens:g} tokens and {kv:g} KV tokens"
        if (
            plan.ent_concurrency < 1
            or kv > plan.ent_kv
            or (plan.own_required and tokens > view.own_bucket.depth)
        ):
            return Reject(
                Reason.EXCEEDS_ENTITLEMENT,
                Check.SIZE,
                f"{needs}; entitlement {view.ent.name!r} can never hold that (lower "
                "max_tokens or raise the entitlement)",
            )
        return Reject(
            Reason.EXCEEDS_POOL,
            Check.SIZE,
            f"{needs}; pool {pool_view.pool.name!r} can never hold that at its current capacity",
        )

    def _choose_victims(
        self, view: EntitlementView, pool_view: PoolView, counters: PoolCounters, kv: float
    ) -> list[Lease]:
        """Preemptible leases of strictly lower priority until the request fits the pool's
        capacity; none if it never would."""
        need_c = counters.concurrency + 1 - view.plan.shared_concurrency
        need_k = counters.kv_tokens + kv - view.plan.shared_kv
        if need_c > counters.preemptible_concurrency or need_k > counters.preemptible_kv:
            return []
        victims: list[Lease] = []
        for lease in self._eviction_order(pool_view.pool.name, below=view.priority):
            if need_c <= 0 and need_k <= 0:
                break
            victims.append(lease)
            need_c -= 1
            need_k -= lease.kv_tokens
        return victims if need_c <= 0 and need_k <= 0 else []

    def _eviction_order(self, pool: str, below: float) -> Iterator[Lease]:
        """Preemptible leases with priority below `below`: lowest priority first, and the
        newest first within an entitlement (it has lost the least work)."""
        groups = self.store.preemptible_leases(pool)
        for name in self._pools[pool].preemptible_order:
            if self._ents[name].priority >= below:
                return
            group = groups.get(name)
            if group:
                yield from reversed(list(group.values()))

    def _reject(
        self,
        short: Shortfall,
        view: EntitlementView,
        pool_view: PoolView,
        counters: PoolCounters,
        tokens: float,
        kv: float,
        request_id: str,
        now: float,
    ) -> Reject:
        reason, check, dimension, message = SHORTFALL_REJECTS[short]
        period = self.policy.update_period_s
        wait = expected_wait_s(
            short,
            tokens,
            kv,
            view.plan,
            counters,
            self.store.entitlement_counters(view.ent.name, now)
            if short in _ENTITLEMENT_SHORTFALLS
            else _NO_COUNTERS,
            pool_view.bucket,
            view.own_bucket,
            pool_view.mean_service_s,
            period - math.fmod(now, period),
        )
        return Reject(reason, check, message, jittered(wait, request_id, self.policy), dimension)

    # -- ends of requests ----------------------------------------------------------------

    def settle(self, lease_id: str, usage: Usage, now: float) -> Lease | None:
        """The request finished; charge what it really used and refund the rest."""
        local = lease_id in self.fallback.leases
        try:
            lease = (self.fallback.store if local else self.store).get_lease(lease_id)
            if lease is None:
                return None
            pool_view = self._pools[lease.pool]
            pool = pool_view.pool
            used = (
                pool.input_token_weight * usage.input_tokens
                + pool.output_token_weight * usage.output_tokens
            )
            (self.fallback if local else self.store).settle(lease_id, used, now)
        except StoreUnavailable:  # not a lease of ours and the store is away: it expires there
            return None
        duration = now - lease.started_at
        pool_view.mean_service_s = 0.9 * pool_view.mean_service_s + 0.1 * max(0.0, duration)
        return lease

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        """The request ended without usage (backend down, cancelled before it ran: refund;
        cut off mid-way with unknown usage: refund=False charges the whole reservation)."""
        if lease_id in self.fallback.leases:
            return self.fallback.release(lease_id, now, refund=refund)
        try:
            return self.store.release(lease_id, now, refund=refund)
        except StoreUnavailable:  # not a lease of ours and the store is away: it expires there
            return None

    def renew(self, lease_id: str, now: float) -> bool:
        """Push a long-running request's lease expiry out by one TTL from now. False: the
        lease has ended (evicted by another replica, or expired) and its request must end."""
        expires_at = now + self.policy.lease_ttl_s
        if lease_id in self.fallback.leases:
            return self.fallback.renew(lease_id, expires_at)
        try:
            return self.store.renew(lease_id, expires_at)
        except StoreUnavailable:  # keep running; the store is asked again next time
            return True

    # -- time and capacity ---------------------------------------------------------------

    def tick(self, now: float) -> TickResult:
        """Expire lost leases and expired entitlements; once per update period (once per pool
        across every replica sharing the store) update debt, burst and priority."""
        expired = tuple(self.fallback.expire(now))
        states: dict[str, BindingState] = {}
        if now >= self._next_expiry:
            states = self._rebind(now)
        try:
            if self.fallback.leases:
                self.fallback.hand_over(self.store, now)
            expired += tuple(self.store.expire(now))
            updated = self._update_pools(now)
        except StoreUnavailable:
            updated = []
        return TickResult(expired, tuple(updated), states)

    def _update_pools(self, now: float) -> list[str]:
        period = int(now // self.policy.update_period_s)
        updated = []
        for name, pool_view in self._pools.items():
            if period > pool_view.last_period:
                pool_view.last_period = period
                if self.store.claim_update(name, period):
                    self._update_scores(pool_view, now)
                    updated.append(name)
                    self._order_preemptible(pool_view)
                else:  # another replica updates them: read them once it has, next tick
                    pool_view.scores_pending = True
            elif pool_view.scores_pending:
                pool_view.scores_pending = False
                for member in pool_view.members:
                    self._ents[member].priority = self.store.scores(member).priority
                self._order_preemptible(pool_view)
        return updated

    def _update_scores(self, pool_view: PoolView, now: float) -> None:
        policy = self.policy
        for name in pool_view.members:
            view = self._ents[name]
            ent = view.ent
            obs = observe(self.store.take_window(name, now))
            self.observations[name] = obs
            old = self.store.scores(name)
            bound = view.state == BindingState.BOUND
            debt = (
                ewma(old.debt, service_gap(ent.baseline.throughput, obs), policy.gamma_debt)
                if ent.accrues_debt and bound
                else 0.0
            )
            burst = ewma(old.burst, burst_excess(ent.baseline, obs), policy.gamma_burst)
            scores = Scores(debt=debt, burst=burst)
            view.priority = w = self._priority_of(view, scores)
            self.store.set_scores(name, replace(scores, priority=w))

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
        leases are evicted (lowest priority, newest first) until what remains fits. Other work
        above the new capacity drains; nothing new is admitted meanwhile."""
        view = self._pools[pool_name]
        if replicas is not None:
            view.pool = view.pool.with_replicas(replicas)
        if per_replica is not None:
            if not per_replica.is_nonnegative():
                raise ValueError(f"pool {pool_name!r}: capacity must be >= 0, got {per_replica}")
            view.pool = replace(view.pool, per_replica=per_replica)
            view.per_replica_override = per_replica
        view.bucket = plans.pool_bucket(view.pool, self.policy)
        states = self._rebind(now)
        cap = view.pool.capacity
        evicted: list[Lease] = []
        try:  # unreachable store: admissions already use the new capacity; nothing evicted
            counters = self.store.pool_counters(pool_name, now)
            over_c = counters.concurrency - cap.concurrency
            over_k = counters.kv_tokens - cap.kv_tokens
            for lease in self._eviction_order(pool_name, below=math.inf):
                if over_c <= 0 and over_k <= 0:
                    break
                self.store.release(lease.lease_id, now, refund=False)
                evicted.append(lease)
                over_c -= 1
                over_k -= lease.kv_tokens
        except StoreUnavailable:
            pass
        return CapacityChange(tuple(evicted), states)

    def desired_replicas(self, pool_name: str) -> int:
        view = self._pools[pool_name]
        members: Sequence[Entitlement] = [
            self._ents[n].ent for n in view.members if self._ents[n].state != BindingState.EXPIRED
        ]
        return desired_replicas(view.pool, capacity_need(members, self.observations))
