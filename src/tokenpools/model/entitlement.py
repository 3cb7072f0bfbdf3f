"""A tenant's entitlement to a share of one pool (the TokenEntitlement CRD)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tokenpools.model.resources import Resources
from tokenpools.model.service_class import CLASS_SEMANTICS, PROTECTED, ServiceClass


class BindingState(StrEnum):
    PENDING = "Pending"  # never bound yet: its baseline has not fitted the pool
    BOUND = "Bound"
    DEGRADED = "Degraded"  # was bound, lost its binding when capacity shrank
    EXPIRED = "Expired"


@dataclass(frozen=True, slots=True)
class Entitlement:
    name: str
    tenant_id: str
    pool: str
    service_class: ServiceClass
    baseline: Resources  # λ_e tokens/s, χ_e KV tokens, r_e sequences
    slo_target_ms: float | None = None
    # Per-dimension ceilings for classes that may burst; None means "up to the pool's capacity".
    burst_ceiling: Resources | None = None
    default_max_tokens: int | None = None  # None → the policy's default
    expires_at: float | None = None  # seconds on the host's clock (epoch for the gateway)
    api_key_hashes: tuple[str, ...] = ()

    @property
    def protected(self) -> bool:
        return self.service_class in PROTECTED

    @property
    def can_burst(self) -> bool:
        return CLASS_SEMANTICS[self.service_class].can_burst

    @property
    def accrues_debt(self) -> bool:
        return CLASS_SEMANTICS[self.service_class].accrues_debt
