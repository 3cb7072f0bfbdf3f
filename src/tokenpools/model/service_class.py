"""Service classes and their semantics (the paper's Table 1)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ServiceClass(StrEnum):
    DEDICATED = "dedicated"
    GUARANTEED = "guaranteed"
    ELASTIC = "elastic"
    SPOT = "spot"
    PREEMPTIBLE = "preemptible"


class UnderPressure(StrEnum):
    NEVER_SHRUNK = "never-shrunk"
    SHRUNK = "shrunk"  # elastic: loses share and accrues debt
    THROTTLED = "throttled"  # spot: new requests rejected first
    EVICTED = "evicted"  # preemptible: in-flight requests terminated


@dataclass(frozen=True, slots=True)
class ClassSemantics:
    weight: float
    reserved: bool  # baseline held for the tenant (binding must fit it in every dimension)
    can_burst: bool  # may use capacity beyond its own baseline
    accrues_debt: bool
    under_pressure: UnderPressure
    # lower binds first and is reclaimed last; equal ranks never displace each other, so
    # dedicated and guaranteed share one: a new dedicated entitlement waits for room instead
    # of preempting a bound guaranteed one (the paper never touches either)
    bind_rank: int


CLASS_SEMANTICS: dict[ServiceClass, ClassSemantics] = {
    ServiceClass.DEDICATED: ClassSemantics(1000.0, True, True, True, UnderPressure.NEVER_SHRUNK, 0),
    ServiceClass.GUARANTEED: ClassSemantics(
        1000.0, True, False, True, UnderPressure.NEVER_SHRUNK, 0
    ),
    ServiceClass.ELASTIC: ClassSemantics(100.0, False, True, True, UnderPressure.SHRUNK, 1),
    ServiceClass.SPOT: ClassSemantics(1.0, False, True, False, UnderPressure.THROTTLED, 2),
    ServiceClass.PREEMPTIBLE: ClassSemantics(0.1, False, True, False, UnderPressure.EVICTED, 3),
}

PROTECTED = frozenset({ServiceClass.DEDICATED, ServiceClass.GUARANTEED})
