"""Admission while the shared store is unreachable (docs/redis.md).

Spot, preemptible and elastic traffic fails closed: without the shared ledger a replica cannot
know what the others admitted. A bound protected (dedicated, guaranteed) entitlement keeps a
local budget on each replica — `fraction` of its baseline — so guaranteed traffic keeps
flowing. The leases admitted here live in a private memory store; once the shared store answers
again they are handed over to it, each exactly once, and settle there.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenpools.control import plans
from tokenpools.control.decisions import SHORTFALL_REJECTS, Admit, Check, Decision, Reason, Reject
from tokenpools.model.entitlement import Entitlement
from tokenpools.state.base import INF, BucketSpec, Lease, ReservePlan, Store
from tokenpools.state.memory import MemoryStore

_UNBOUNDED = BucketSpec(INF, INF)


class LocalFallback:
    def __init__(self, fraction: float, retry_after_s: float) -> None:
        self.fraction = fraction
        self.retry_after_s = retry_after_s
        self.store = MemoryStore()
        self._limits: dict[str, tuple[BucketSpec, ReservePlan]] = {}
        self._pools: set[str] = set()

    def admit(
        self, ent: Entitlement, own: BucketSpec, priority: float, lease: Lease, now: float
    ) -> Decision:
        if not ent.protected or self.fraction <= 0:
            return Reject(
                Reason.STORE_UNAVAILABLE,
                Check.STATE,
                f"the shared state store is unreachable; {ent.service_class.value} traffic "
                "is refused until it is back",
                self.retry_after_s,
            )
        plan = self._configure(ent, own, lease.pool, now)
        short = self.store.reserve(lease, plan, now)
        if short is not None:
            reason, check, dimension, message = SHORTFALL_REJECTS[short]
            message = f"{message} (local budget while the shared state store is unreachable)"
            return Reject(reason, check, message, self.retry_after_s, dimension)
        return Admit(lease, priority)

    def _configure(self, ent: Entitlement, own: BucketSpec, pool: str, now: float) -> ReservePlan:
        plan, bucket = plans.fallback_limits(ent, own, self.fraction)
        if pool not in self._pools:
            self.store.configure_pool(pool, _UNBOUNDED, _UNBOUNDED, now)
            self._pools.add(pool)
        if self._limits.get(ent.name) != (bucket, plan):
            self.store.configure_entitlement(
                ent.name, pool, bucket, plan.base_concurrency, plan.base_kv, now, protected=True
            )
            self._limits[ent.name] = (bucket, plan)
        return plan

    @property
    def leases(self) -> Mapping[str, Lease]:
        """The requests admitted here and not ended yet, by lease id."""
        return self.store.leases

    def settle(self, lease_id: str, used_tokens: float, now: float) -> Lease | None:
        return self.store.settle(lease_id, used_tokens, now)

    def release(self, lease_id: str, now: float, refund: bool = True) -> Lease | None:
        return self.store.release(lease_id, now, refund=refund)

    def renew(self, lease_id: str, expires_at: float) -> bool:
        return self.store.renew(lease_id, expires_at)

    def expire(self, now: float) -> list[Lease]:
        return self.store.expire(now)

    def hand_over(self, shared: Store, now: float) -> int:
        """Book the local leases in the shared store and forget them here. Raises
        StoreUnavailable if it went away again; what was handed over stays handed over."""
        count = 0
        for lease in list(self.leases.values()):
            shared.adopt(lease, now)  # idempotent: a lease already there is not booked twice
            self.store.release(lease.lease_id, now, refund=False)
            count += 1
        return count
