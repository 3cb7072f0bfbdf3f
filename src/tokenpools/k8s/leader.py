"""Leader election on a coordination.k8s.io Lease, so two operator replicas never both act.

Optimistic concurrency does the work: a replica takes or renews the Lease with a PUT that
carries the resourceVersion it read; if another replica wrote in between, the API server
answers 409 and this replica is not the leader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenpools.k8s import objects as o
from tokenpools.k8s.api import LEASES, Conflict, Kube


class LeaderElection:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        identity: str,
        clock: Callable[[], float],
        name: str = "tokenpools-operator",
        duration_s: int = 15,
    ) -> None:
        self.kube, self.namespace, self.identity = kube, namespace, identity
        self.clock, self.name, self.duration_s = clock, name, duration_s

    def try_acquire(self) -> bool:
        """Take the Lease when it is free or expired, renew it when it is ours."""
        now = self.clock()
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration_s,
            "renewTime": o.micro(now),
        }
        lease: Any = self.kube.find(LEASES, self.namespace, self.name)
        if lease is None:
            body = {
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**spec, "acquireTime": o.micro(now)},
            }
            try:
                self.kube.create(LEASES, self.namespace, body)
                return True
            except Conflict:
                return False
        held = lease.get("spec") or {}
        renewed = held.get("renewTime")
        expired = renewed is None or now - o.parse_time(renewed) > held.get(
            "leaseDurationSeconds", 0
        )
        if held.get("holderIdentity") != self.identity and not expired:
            return False
        if held.get("holderIdentity") != self.identity:
            spec["acquireTime"] = o.micro(now)
        lease["spec"] = {**held, **spec}
        try:
            self.kube.replace(LEASES, self.namespace, self.name, lease)
        except Conflict:
            return False
        return True
