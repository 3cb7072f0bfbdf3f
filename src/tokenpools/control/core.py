"""The decision core: every host (gateway, simulator, emulator, operator) calls this.

Hosts feed it events — a request arrives, a request ends, time passes, capacity changes,
config changes — and act on the values it returns. It keeps only config-derived data and
caches; everything that changes per request lives in the store.

`DecisionCore` is the face; the work is its collaborators', each in its own module: the
catalog (catalog.py: what is configured and how it is bound), the gatekeeper (gatekeeper.py:
the decision on each request), endings (endings.py: settle, release, renew) and the periodic
work (periodic.py: ticks and capacity changes). They share the store, the local fallback
budget and the catalog's views; none reaches into another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenpools.control import pipeline
from tokenpools.control.budgets import Budgets
from tokenpools.control.catalog import Catalog
from tokenpools.control.decisions import CapacityChange, Decision, Reject, TickResult
from tokenpools.control.endings import Ending, Endings
from tokenpools.control.fallback import LocalFallback, LocalStore
from tokenpools.control.gatekeeper import Gatekeeper, Pending
from tokenpools.control.metering import Charge, PendingUsage, UsageRow
from tokenpools.control.observation import Observation
from tokenpools.control.periodic import Periodic
from tokenpools.control.store import (
    Lease,
    Outcome,
    Scores,
    Store,
    StoreUnavailable,
)
from tokenpools.control.views import EntitlementView, PoolView
from tokenpools.model.config import Config
from tokenpools.model.policy import Policy
from tokenpools.model.request import RequestCost, Usage
from tokenpools.model.resources import Resources

__all__ = ["DecisionCore", "Pending"]


class DecisionCore:
    def __init__(
        self,
        config: Config,
        store: Store,
        now: float = 0.0,
        replica: str = "r0",
        fallback_store: LocalStore | None = None,
        suspends: bool = False,
    ) -> None:
        """`store` holds the ledger; `fallback_store`, a private one, holds what the outage
        policy admits while a shared `store` is unreachable (none: everything fails closed).
        `suspends`: the host suspends the requests the core takes back (and resumes them) as
        the policy's `suspend` asks; a host that cannot ends them, and the core lends as if
        `suspend` were off (docs/decisions.md, "Lending, and taking back")."""
        self.store = store
        self.fallback = LocalFallback(
            config.state.fallback_fraction, config.state.retry_interval_s, fallback_store
        )
        self.catalog = Catalog(store, config, now, suspends)
        self.gatekeeper = Gatekeeper(self.catalog, store, self.fallback, replica)
        self.endings = Endings(self.catalog, store, self.fallback)
        self.periodic = Periodic(self.catalog, store, self.fallback)

    # -- configuration -------------------------------------------------------------------

    def apply_config(self, config: Config, now: float) -> tuple[Lease, ...]:
        """Adopt a new config, keeping the state of entitlements that remain. Returns the
        leases of removed entitlements: the host must end those requests."""
        self.fallback.fraction = config.state.fallback_fraction
        self.fallback.retry_after_s = config.state.retry_interval_s
        return self.catalog.apply_config(config, now)

    @property
    def config(self) -> Config:
        return self.catalog.config

    @property
    def policy(self) -> Policy:
        return self.catalog.policy

    @property
    def budgets(self) -> Budgets:
        return self.catalog.budgets

    @property
    def entitlements(self) -> Mapping[str, EntitlementView]:
        return self.catalog.entitlements

    @property
    def pools(self) -> Mapping[str, PoolView]:
        return self.catalog.pools

    # -- admission (control/pipeline.py: the whole of one; gatekeeper.py: its steps) -------

    def admit(
        self,
        entitlement: str | Sequence[str],
        cost: RequestCost,
        now: float,
        request_id: str | None = None,
    ) -> Decision:
        """A whole admission on the store the core was given: the request's layers (one
        entitlement, or several in layer order), and the retry with `max_tokens` lowered to
        fit a budget where the config says so."""
        names = (entitlement,) if isinstance(entitlement, str) else entitlement
        return pipeline.run(self.gatekeeper, names, cost, now, request_id)

    def admission(
        self, names: Sequence[str], cost: RequestCost, now: float, request_id: str | None = None
    ) -> pipeline.Admission:
        """The same admission for a host that awaits its store: it yields each store step's
        reservations and is sent what the store did (admission/driver.py runs it)."""
        return pipeline.admission(self.gatekeeper, names, cost, now, request_id)

    def prepare(
        self, entitlement: str, cost: RequestCost, now: float, request_id: str | None = None
    ) -> Pending | Reject:
        return self.gatekeeper.prepare(entitlement, cost, now, request_id)

    def decide(self, step: Pending, outcome: Outcome | None, now: float) -> Decision:
        return self.gatekeeper.decide(step, outcome, now)

    # -- the ends of requests (endings.py) ---------------------------------------------

    def settle(self, lease_id: str, usage: Usage, now: float) -> Lease | None:
        return self.endings.settle(lease_id, usage, now)

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        return self.endings.release(lease_id, now, refund)

    def prepare_end(self, lease: Lease, usage: Usage | None, refund: bool = True) -> Ending:
        return self.endings.prepare_end(lease, usage, refund)

    def end_on_store(self, ending: Ending, now: float) -> bool:
        return self.endings.end_on_store(ending, now)

    def ended(self, ending: Ending, now: float) -> None:
        self.endings.ended(ending, now)

    def charge(self, lease: Lease, usage: Usage) -> Charge | None:
        return self.endings.charge(lease, usage)

    def recharge(self, lease: Lease, usage: Usage, now: float) -> None:
        self.endings.recharge(lease, usage, now)

    def renewal(self, lease_id: str, now: float) -> tuple[float, bool]:
        return self.endings.renewal(lease_id, now)

    def renew(self, lease_id: str, now: float) -> bool:
        return self.endings.renew(lease_id, now)

    # -- time and capacity (periodic.py) ------------------------------------------------

    def tick(self, now: float) -> TickResult:
        return self.periodic.tick(now)

    def set_replicas(self, pool_name: str, replicas: int, now: float) -> CapacityChange:
        return self.periodic.set_replicas(pool_name, replicas, now)

    def set_capacity(
        self,
        pool_name: str,
        now: float,
        replicas: int | None = None,
        per_replica: Resources | None = None,
    ) -> CapacityChange:
        return self.periodic.set_capacity(pool_name, now, replicas, per_replica)

    def desired_replicas(self, pool_name: str) -> int:
        return self.periodic.desired_replicas(pool_name)

    @property
    def observations(self) -> Mapping[str, Observation]:
        """Each entitlement's usage in the last update period."""
        return self.periodic.observations

    # -- the local budget while a shared store is away (fallback.py) -----------------------

    def local_leases(self) -> Mapping[str, Lease]:
        """What the local budget admitted while the shared store was away, still held here,
        by lease id (a live, read-only view)."""
        return self.fallback.leases

    def handed_over(self, lease: Lease, now: float) -> bool:
        """`lease` is booked in the shared store now: forgotten here. False if its request
        ended here while it was on its way (the shared store must end it too)."""
        return self.fallback.handed_over(lease, now)

    def hand_over_by_host(self) -> None:
        """The host books the local leases in the shared store itself, awaited on its event
        loop (admission/driver.py), instead of the tick doing it on the store."""
        self.fallback.hand_over_on_tick = False

    # -- the usage ledger, as the store counts it -----------------------------------------

    def pending_usage(self, pool: str, now: float, limit: int) -> PendingUsage:
        return self.store.pending_usage(pool, now, limit)

    def ack_usage(self, pool: str, rows: Sequence[UsageRow], now: float) -> None:
        self.store.ack_usage(pool, rows, now)

    # -- reads -------------------------------------------------------------------------

    def scores(self, entitlement: str, now: float) -> Scores:
        """An entitlement's debt, burst and priority as the store holds them."""
        return self.store.scores(entitlement, now)

    def within_baseline(self, entitlement: str, now: float) -> bool:
        """Whether one more request of a protected entitlement would be within its baseline's
        concurrency now: in flight and baseline concurrency only (what a report splits its SLO
        attainment by; admission itself decides in the store's step, on KV and its own bucket
        too). False for an entitlement that is not protected: it has no promised baseline."""
        view = self.catalog.entitlements.get(entitlement)
        if view is None or not view.protected:
            return False
        in_flight = self.store.entitlement_counters(entitlement, now).concurrency
        return in_flight + 1 <= view.ent.baseline.concurrency

    def store_answers(self, now: float) -> bool:
        """Whether the store answers a read now."""
        if not self.catalog.pools:
            return True
        try:
            self.store.pool_counters(next(iter(self.catalog.pools)), now)
        except StoreUnavailable:
            return False
        return True
