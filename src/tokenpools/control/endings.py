"""The ends of requests — settled on their usage, released, renewed — with the same split as
admission: the core prepares what the store must do (`prepare_end`: the lease, the tokens
charged, whether this process holds it), the host runs it on its store (inline with
`end_on_store`, or awaiting a remote store), and the core takes the result (`ended`). The
synchronous `settle` / `release` / `renew` are those steps in one call; no host repeats the
rules (which store holds a lease, what a usage costs, what an unreachable store means).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from tokenpools.control import budgets
from tokenpools.control.backfill import rescaled, typical_output
from tokenpools.control.catalog import Catalog
from tokenpools.control.fallback import LocalFallback
from tokenpools.control.metering import Charge
from tokenpools.control.store import Lease, Store, StoreUnavailable
from tokenpools.model.request import Usage


@dataclass(frozen=True, slots=True)
class Ending:
    """How one admission lease ends: settled on `charged` weighted tokens, or released
    (`charged` None: refunded, or charged its whole reservation without `refund`)."""

    lease: Lease
    charged: float | None
    refund: bool
    local: bool  # held by this process's fallback budget, not by the store
    charge: Charge | None = None  # a metered lease's usage in every measure
    output_tokens: int = 0  # what a settled request generated


class Endings:
    """The core's collaborator for the ends of requests: it reads the catalog's pools (their
    token weights, and what a settled request teaches them) and ends leases on the store that
    holds them (the store, or this process's fallback budget)."""

    def __init__(self, catalog: Catalog, store: Store, fallback: LocalFallback) -> None:
        self.catalog, self.store, self.fallback = catalog, store, fallback

    def prepare_end(self, lease: Lease, usage: Usage | None, refund: bool = True) -> Ending:
        charged = None if usage is None else self.used_tokens(lease, usage)
        charge = None if usage is None else self.charge(lease, usage)
        local = lease.lease_id in self.fallback.leases
        output = 0 if usage is None else usage.output_tokens
        return Ending(lease, charged, refund, local, charge, output)

    def end_on_store(self, ending: Ending, now: float) -> bool:
        """Run an ending on the store the core was given (the fallback for a local lease);
        False when the store is unreachable (the lease expires there)."""
        lease_id, charged = ending.lease.lease_id, ending.charged
        try:
            if charged is None:
                self._release(lease_id, ending.local, ending.refund, now)
            else:
                self._holder(ending.local).settle(lease_id, charged, now, ending.charge)
        except StoreUnavailable:
            return False
        self.ended(ending, now)
        return True

    def _holder(self, local: bool) -> Store | LocalFallback:
        """The store that holds a lease: this process's fallback budget, or the store."""
        return self.fallback if local else self.store

    def _release(self, lease_id: str, local: bool, refund: bool, now: float) -> Lease | None:
        return self._holder(local).release(lease_id, now, refund=refund)

    def ended(self, ending: Ending, now: float) -> None:
        """A settled request's duration feeds the Retry-After estimate, its output the pool's
        typical request, and a preemptible one its pool's claim scale."""
        if ending.charged is not None:
            self._served(ending.lease, ending.output_tokens, now)

    def _served(self, lease: Lease, output_tokens: int, now: float) -> None:
        pool_view = self.catalog.pools.get(lease.pool)
        if pool_view is not None:
            duration = max(0.0, now - lease.started_at)
            pool_view.mean_service_s = 0.9 * pool_view.mean_service_s + 0.1 * duration
            pool_view.typical_output = typical_output(pool_view.typical_output, output_tokens)
            if lease.preemptible:
                pool_view.claim_scale = rescaled(pool_view.claim_scale, False, self.catalog.policy)

    def used_tokens(self, lease: Lease, usage: Usage) -> float:
        """What a finished request is charged, in its pool's weighted tokens."""
        pool = self.catalog.pools[lease.pool].pool
        return (
            pool.input_token_weight * usage.input_tokens
            + pool.output_token_weight * usage.output_tokens
        )

    def charge(self, lease: Lease, usage: Usage) -> Charge | None:
        """A metered lease's usage in every measure its budgets and ledger count (None: not
        metered, or its pool is gone from the config)."""
        pool_view = self.catalog.pools.get(lease.pool)
        if lease.meter is None or pool_view is None:
            return None
        return budgets.used(pool_view.pool, usage)

    def settle(self, lease_id: str, usage: Usage, now: float) -> Lease | None:
        """The request finished; charge what it really used and refund the rest."""
        holder: Store | LocalFallback = (
            self.fallback if lease_id in self.fallback.leases else self.store
        )
        try:  # the hot path of every host that runs its store inline: no Ending made here
            lease = holder.get_lease(lease_id, now)
            if lease is None:
                return None
            holder.settle(lease_id, self.used_tokens(lease, usage), now, self.charge(lease, usage))
        except StoreUnavailable:  # not a lease of ours and the store is away: it expires there
            return None
        self._served(lease, usage.output_tokens, now)
        return lease

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        """The request ended without usage (backend down, cancelled before it ran: refund;
        cut off mid-way with unknown usage: refund=False charges the whole reservation)."""
        try:
            return self._release(lease_id, lease_id in self.fallback.leases, refund, now)
        except StoreUnavailable:  # not a lease of ours and the store is away: it expires there
            return None

    def recharge(self, lease: Lease, usage: Usage, now: float) -> None:
        """A metered lease taken back on its worst case (an eviction the host turned into a
        suspension) is charged `usage` instead (Store.recharge). An unreachable store keeps
        the worst case charged."""
        charge = self.charge(lease, usage)
        if charge is not None:
            with contextlib.suppress(StoreUnavailable):
                self.store.recharge(lease, charge, now)

    def renewal(self, lease_id: str, now: float) -> tuple[float, bool]:
        """(the new expiry, whether this process's fallback holds the lease)."""
        return now + self.catalog.policy.lease_ttl_s, lease_id in self.fallback.leases

    def renew(self, lease_id: str, now: float) -> bool:
        """Push a long-running request's lease expiry out by one TTL from now. False: the
        lease has ended (evicted by another replica, or expired) and its request must end."""
        expires_at, local = self.renewal(lease_id, now)
        try:
            return self._holder(local).renew(lease_id, expires_at, now)
        except StoreUnavailable:  # keep running; the store is asked again next time
            return True
