"""The gatekeeper: the decision on each request. `prepare` makes checks 1 and 2 (bound, and
never too big) and the reservation the store must run, `decide` turns what the store did with
it into the decision (an Admit, or a Reject with its Retry-After); the store step between them
is the host's, one call (control/pipeline.py runs the three). A collaborator of DecisionCore
(core.py), beside the catalog it reads its views from.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenpools.control.backfill import claim_share
from tokenpools.control.budgets import tightest
from tokenpools.control.catalog import Catalog
from tokenpools.control.decisions import (
    SHORTFALL_REJECTS,
    STATE_REASONS,
    Admit,
    Check,
    Decision,
    Reason,
    Reject,
    quota,
)
from tokenpools.control.fallback import LocalFallback
from tokenpools.control.retry import expected_wait_s, jittered
from tokenpools.control.store import (
    Lease,
    Outcome,
    Reservation,
    ReservePlan,
    Shortfall,
    Store,
)
from tokenpools.control.views import EntitlementView, PoolView
from tokenpools.model.entitlement import BindingState
from tokenpools.model.request import RequestCost
from tokenpools.model.service_class import ServiceClass


@dataclass(slots=True)
class Pending(Reservation):
    """A reservation between `prepare` and `decide`, with what the core decides on: the host
    runs it on its store (awaiting it, if the store is remote) and hands the outcome back."""

    view: EntitlementView
    pool_view: PoolView
    max_tokens: int  # the request's max_tokens, the entitlement's default if it set none
    sequences: int = 1

    # written out for mypyc (control/store_terms.py says why, above Lease)
    def __init__(
        self,
        lease: Lease,
        plan: ReservePlan,
        demand: float,
        victims: Sequence[str],
        victim_count: int,
        may_overcommit: bool,
        claim_share: float,
        view: EntitlementView,
        pool_view: PoolView,
        max_tokens: int,
        sequences: int = 1,
    ) -> None:
        self.lease, self.plan, self.demand = lease, plan, demand
        self.victims, self.victim_count = victims, victim_count
        self.may_overcommit, self.claim_share = may_overcommit, claim_share
        self.view, self.pool_view = view, pool_view
        self.max_tokens, self.sequences = max_tokens, sequences


class Gatekeeper:
    def __init__(
        self, catalog: Catalog, store: Store, fallback: LocalFallback, replica: str
    ) -> None:
        self.catalog, self.store, self.fallback = catalog, store, fallback
        self._replica = replica
        self._seq = itertools.count(1)

    def prepare(
        self, entitlement: str, cost: RequestCost, now: float, request_id: str | None = None
    ) -> Pending | Reject:
        """Checks 1 and 2, and the reservation the store must run; a Reject needs no store."""
        view = self.catalog.entitlements.get(entitlement)
        if view is None:
            return Reject(
                Reason.UNKNOWN_ENTITLEMENT, Check.STATE, f"unknown entitlement {entitlement!r}"
            )
        ent = view.ent
        if view.state != BindingState.BOUND or (
            ent.expires_at is not None and now >= ent.expires_at
        ):
            if view.state == BindingState.BOUND:  # expired since the last tick
                self.catalog.rebind(now)
            reason = STATE_REASONS[self.catalog.entitlements[entitlement].state]
            return Reject(reason, Check.STATE, f"entitlement {entitlement!r} is not bound")

        pool_view = self.catalog.pools[ent.pool]
        pool = pool_view.pool
        max_out = cost.max_output_tokens  # paper check 2: the entitlement's default if unset
        if max_out is None:
            max_out = view.default_max_tokens
        # n sequences share their prompt's KV (prefix) and each may generate up to the ceiling
        out = max_out * cost.sequences
        tokens = pool.input_token_weight * cost.input_tokens + pool.output_token_weight * out
        kv = float(cost.input_tokens + out)
        if tokens > view.size_limit_tokens or kv > view.size_limit_kv:
            # Not counted as demand: no capacity could ever serve it, so it is owed nothing.
            return self._too_big(view, pool_view, tokens, kv)

        lease_id = self.new_lease_id() if request_id is None else request_id
        account = cost.account
        # a request of a lent class the host cannot take back is kept off lent capacity:
        # taking back suspends spot work (it must be resumable) and ends preemptible work
        # (the host must be able to end it)
        # (only a lent class has a kept plan: every other request pays one test here)
        kept = view.kept_plan is not None and not (
            cost.endable and (cost.resumable or view.ent.service_class is ServiceClass.PREEMPTIBLE)
        )
        plan = view.kept_plan if kept and view.kept_plan is not None else view.plan
        lease = Lease(
            lease_id,
            pool.name,
            entitlement,
            tokens,
            kv,
            now,
            now + self.catalog.policy.lease_ttl_s,
            view.preemptible and not kept,
            meter=None
            if account is None
            else self.catalog.budgets.meter(account, ent, pool, cost.input_tokens, out, now),
            # taking it back suspends it (control/views.py `suspendable`; a request the host
            # cannot resume or end never is)
            resumable=view.suspendable and cost.resumable and cost.endable,
        )
        # Who this request may evict: the pool's preemptible entitlements strictly below it,
        # if the pool owes it capacity.
        count = (
            bisect.bisect_left(pool_view.preemptible_priorities, view.priority)
            if view.may_evict
            else 0
        )
        order = pool_view.preemptible_order
        share = (
            claim_share(out, pool_view.typical_output, pool_view.claim_scale)
            if view.plan.surplus
            else 0.0
        )
        return Pending(
            lease,
            plan,
            tokens,
            order,
            count,
            view.protected,
            share,
            view,
            pool_view,
            max_out,
            cost.sequences,
        )

    def new_lease_id(self) -> str:
        return f"{self._replica}-{next(self._seq)}"

    def decide(self, step: Pending, outcome: Outcome | None, now: float) -> Decision:
        """The decision, from what the store did with the reservation (None: the store was
        unreachable, and the outage policy decides)."""
        view, lease = step.view, step.lease
        if outcome is None:
            if lease.meter is not None and lease.meter.holds:
                return Reject(
                    Reason.STORE_UNAVAILABLE,
                    Check.BUDGET,
                    "the shared state store is unreachable; requests charged to a budget are "
                    "refused until it is back (a budget is never overspent)",
                    self.fallback.retry_after_s,
                )
            if lease.lease_id in self.fallback.leases:
                raise ValueError(f"request id {lease.lease_id!r} already holds a lease")
            return self.fallback.admit(
                view.ent, view.own_bucket, view.priority, lease, now, step.max_tokens
            )
        if outcome.shortfall is None:
            if outcome.evicted:
                self.catalog.note_evicted(outcome.evicted)
            return Admit(
                lease,
                view.priority,
                outcome.evicted,
                outcome.overcommit,
                step.max_tokens,
                # only where the host asked the store for counters after an admission
                None if outcome.entitlement is None else quota(view, step.pool_view, outcome),
                tightest(lease.meter, outcome.budget_left),
            )
        if outcome.shortfall == Shortfall.BUDGET:
            return self._over_budget(step, outcome, now)
        return self._reject(outcome, step, now)

    def _over_budget(self, step: Pending, outcome: Outcome, now: float) -> Reject:
        meter, left = step.lease.meter, outcome.budget_left
        assert meter is not None
        fit = self.catalog.budgets.fitting_output(meter, left, step.pool_view.pool, step.sequences)
        return self.catalog.budgets.refusal(
            meter, outcome.budget_refused, left[outcome.budget_refused], now, fit
        )

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

    def _reject(self, outcome: Outcome, step: Pending, now: float) -> Reject:
        short = outcome.shortfall
        assert short is not None and outcome.pool is not None and outcome.entitlement is not None
        view, lease = step.view, step.lease
        reason, check, dimension, message = SHORTFALL_REJECTS[short]
        period = self.catalog.policy.update_period_s
        wait = expected_wait_s(
            short,
            lease.tokens,
            lease.kv_tokens,
            view.plan,
            outcome.pool,
            outcome.entitlement,
            step.pool_view.bucket,
            view.own_bucket,
            step.pool_view.mean_service_s,
            period - math.fmod(now, period),
        )
        wait = jittered(wait, lease.lease_id, self.catalog.policy)
        return Reject(reason, check, message, wait, dimension, quota(view, step.pool_view, outcome))
