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

from collections.abc import Mapping

from tokenpools.control.budgets import Budgets
from tokenpools.control.catalog import Catalog
from tokenpools.control.decisions import CapacityChange, Decision, Reject, TickResult
from tokenpools.control.endings import Ending, Endings
from tokenpools.control.fallback import LocalFallback, LocalStore
from tokenpools.control.gatekeeper import Gatekeeper, Pending
from tokenpools.control.metering import Charge
from tokenpools.control.observation import Observation
from tokenpools.control.periodic import Periodic
from tokenpools.control.store import Lease, Outcome, Scores, Store, StoreUnavailable
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
    ) -> None:
        """`store` holds the ledger; `fallback_store`, a private one, holds what the outage
        policy admits while a shared `store` is unreachable (none: everything fails closed)."""
        self.store = store
        self.fallback = LocalFallback(
            config.state.fallback_fraction, config.state.retry_interval_s, fallback_store
        )
        self.catalog = Catalog(store, config, now)
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

    # -- admission (gatekeeper.py; control/pipeline.py runs a whole one) --------------------

    def admit(
        self, entitlement: str, cost: RequestCost, now: float, request_id: str | None = None
    ) -> Decision:
        """One entitlement, one store step, on the store the core was given (no lowered
        retry: control/pipeline.py's `run` is a whole admission)."""
        return self.gatekeeper.admit(entitlement, cost, now, request_id)

    def prepare(
        self, entitlement: str, cost: RequestCost, now: float, request_id: str | None = None
    ) -> Pending | Reject:
        return self.gatekeeper.prepare(entitlement, cost, now, request_id)

    def decide(self, step: Pending, outcome: Outcome | None, now: float) -> Decision:
        return self.gatekeeper.decide(step, outcome, now)

    def new_lease_id(self) -> str:
        return self.gatekeeper.new_lease_id()

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

    # -- reads -------------------------------------------------------------------------

    def scores(self, entitlement: str, now: float) -> Scores:
        """An entitlement's debt, burst and priority as the store holds them."""
        return self.store.scores(entitlement, now)

    def store_answers(self, now: float) -> bool:
        """Whether the store answers a read now."""
        if not self.catalog.pools:
            return True
        try:
            self.store.pool_counters(next(iter(self.catalog.pools)), now)
        except StoreUnavailable:
            return False
        return True
