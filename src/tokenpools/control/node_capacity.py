"""How many replicas a pool's virtual node advertises: what is ready, but a dip must last.

Capacity grows at once (more room never hurts a bound entitlement) and shrinks only after the
ready replicas have stayed lower for `shrink_after_s`: a rolling update or a readiness blip
must not evict guaranteed leases that the next probe would have kept."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Advertised:
    replicas: int
    dip_since: float | None = None  # when ready replicas fell below `replicas`


def advertise(
    previous: Advertised | None, ready: int, now: float, shrink_after_s: float
) -> Advertised:
    if previous is None or ready >= previous.replicas:
        return Advertised(ready)
    since = now if previous.dip_since is None else previous.dip_since
    if now - since >= shrink_after_s:
        return Advertised(ready)
    return Advertised(previous.replicas, since)
