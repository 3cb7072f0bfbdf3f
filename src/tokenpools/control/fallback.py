"""Admission while the shared store is unreachable (docs/redis.md).

Spot, preemptible and elastic traffic fails closed: without the shared ledger a replica cannot
know what the others admitted. A bound protected (dedicated, guaranteed) entitlement keeps a
local budget on each replica — `fraction` of its baseline — so guaranteed traffic keeps
flowing. The leases admitted here live in a private memory store; once the shared store answers
again they are handed over to it, each exactly once, and settle there. The host gives it that
private store (a memory store); without one, every class fails closed.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from tokenpools.control import plans
from tokenpools.control.decisions import SHORTFALL_REJECTS, Admit, Check, Decision, Reason, Reject
from tokenpools.control.metering import Charge
from tokenpools.control.store import INF, BucketSpec, Lease, Reservation, ReservePlan, Store
from tokenpools.model.entitlement import Entitlement

_UNBOUNDED = BucketSpec(INF, INF)
_NO_LEASES: Mapping[str, Lease] = MappingProxyType({})  # asked on every settle: no allocation


class LocalStore(Store, Protocol):
    """A store in this process, whose leases can be listed."""

    @property
    def leases(self) -> Mapping[str, Lease]: ...


class LocalFallback:
    # A gateway on a shared store runs its ticks on a worker thread while admissions run on
    # the event loop: the lock keeps the private store whole. It is never held across I/O.
    def __init__(self, fraction: float, retry_after_s: float, store: LocalStore | None) -> None:
        self.fraction = fraction
        self.retry_after_s = retry_after_s
        self.store = store
        self._lock = threading.Lock()
        self._limits: dict[str, tuple[BucketSpec, ReservePlan]] = {}
        self._pools: set[str] = set()
        # False where the host hands the leases over itself, on the path its requests' ends
        # take (the gateway on Redis: the event loop), so that an end never races a hand-over
        self.hand_over_on_tick = True

    def admit(
        self,
        ent: Entitlement,
        own: BucketSpec,
        priority: float,
        lease: Lease,
        now: float,
        max_tokens: int = 0,
    ) -> Decision:
        """`max_tokens`: what the reservation assumed, for the Admit."""
        if self.store is None or not ent.protected or self.fraction <= 0:
            return Reject(
                Reason.STORE_UNAVAILABLE,
                Check.STATE,
                f"the shared state store is unreachable; {ent.service_class.value} traffic "
                "is refused until it is back",
                self.retry_after_s,
            )
        with self._lock:
            plan = self._configure(self.store, ent, own, lease.pool, now)
            short = self.store.admit(
                Reservation(lease, plan, 0.0, (), 0, False, 0.0), now
            ).shortfall
        if short is not None:
            reason, check, dimension, message = SHORTFALL_REJECTS[short]
            message = f"{message} (local budget while the shared state store is unreachable)"
            return Reject(reason, check, message, self.retry_after_s, dimension)
        return Admit(lease, priority, max_tokens=max_tokens)

    def _configure(
        self, store: Store, ent: Entitlement, own: BucketSpec, pool: str, now: float
    ) -> ReservePlan:
        plan, bucket = plans.fallback_limits(ent, own, self.fraction)
        if pool not in self._pools:
            store.configure_pool(pool, _UNBOUNDED, _UNBOUNDED, now)
            self._pools.add(pool)
        if self._limits.get(ent.name) != (bucket, plan):
            store.configure_entitlement(
                ent.name, pool, bucket, plan.base_concurrency, plan.base_kv, now, protected=True
            )
            self._limits[ent.name] = (bucket, plan)
        return plan

    @property
    def leases(self) -> Mapping[str, Lease]:
        """The requests admitted here and not ended yet, by lease id."""
        return _NO_LEASES if self.store is None else self.store.leases

    # The rest is only called for a lease in `leases`, so the store exists.

    def settle(
        self, lease_id: str, used_tokens: float, now: float, charge: Charge | None = None
    ) -> Lease | None:
        assert self.store is not None
        with self._lock:
            return self.store.settle(lease_id, used_tokens, now, charge)

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        assert self.store is not None
        with self._lock:
            return self.store.release(lease_id, now, refund=refund)

    def renew(self, lease_id: str, expires_at: float, now: float) -> bool:
        assert self.store is not None
        with self._lock:
            return self.store.renew(lease_id, expires_at, now)

    def get_lease(self, lease_id: str, now: float) -> Lease | None:
        return None if self.store is None else self.store.get_lease(lease_id, now)

    def expire(self, now: float) -> list[Lease]:
        if self.store is None:
            return []
        with self._lock:
            return self.store.expire(now)

    def hand_over(self, shared: Store, now: float) -> int:
        """Book the local leases in the shared store and forget them here. Raises
        StoreUnavailable if it went away again; what was handed over stays handed over."""
        count = 0
        with self._lock:
            leases = list(self.leases.values())
        for lease in leases:
            shared.adopt(lease, now)  # idempotent: a lease already there is not booked twice
            if not self.handed_over(lease, now):
                shared.release(lease.lease_id, now)
            count += 1
        return count

    def handed_over(self, lease: Lease, now: float) -> bool:
        """`lease` is booked in the shared store now: forget it here. False if its request
        ended here while it was on its way, and the shared store must end it too."""
        return self.release(lease.lease_id, now, refund=False) is not None
