"""What one operator replica does over time, as two steps its host calls on two schedules.

`heartbeat` (every HEARTBEAT_S) renews the leader Lease and, while this replica leads, every
virtual node's heartbeat; `reconcile` (on a watch event, or every RESYNC_S) runs one pass of
the Reconciler while it leads. The two never wait for each other: a reconciliation that hangs
on a slow API server or keeps failing cannot stop the heartbeats. Steps catch their own errors
and take the clock from the host, so a test drives many simulated minutes in a few seconds."""

from __future__ import annotations

import logging
from collections.abc import Callable

from tokenpools.k8s.errors import describe
from tokenpools.k8s.leader import LeaderElection
from tokenpools.k8s.reconciler import Reconciler
from tokenpools.k8s.virtual_node import retried

log = logging.getLogger("tokenpools.operator")
HEARTBEAT_S = 10.0
RESYNC_S = 30.0


class OperatorLoop:
    def __init__(self, rec: Reconciler, leader: LeaderElection, clock: Callable[[], float]) -> None:
        self.rec, self.leader, self.clock = rec, leader, clock
        self.leading = False
        self.last_heartbeat: float | None = None  # when a heartbeat step last completed
        self.last_reconcile: float | None = None
        self.passes = 0  # reconciliation passes run

    def heartbeat(self) -> None:
        try:
            self.leading = retried(self.leader.try_acquire)
        except Exception as exc:
            log.warning("leader election failed: %s", describe(exc)[1])
            self.leading = False
        if self.leading:
            self.rec.heartbeat()  # per node, errors counted inside
        self.last_heartbeat = self.clock()

    def reconcile_due(self, woken: bool) -> bool:
        resync = self.last_reconcile is None or self.clock() - self.last_reconcile >= RESYNC_S
        return self.leading and (woken or resync)

    def reconcile(self) -> None:
        """One pass; a failure of the pass as a whole (a list failed) is retried next time."""
        self.last_reconcile = self.clock()
        self.passes += 1
        try:
            self.rec.reconcile()
        except Exception as exc:
            self.rec.metrics.errors.labels("Reconcile", describe(exc)[0]).inc()
            log.warning("reconciliation failed: %s", describe(exc)[1])

    def alive(self) -> bool:
        """For the liveness probe: the heartbeat schedule is running."""
        last = self.last_heartbeat
        return last is not None and self.clock() - last < 6 * HEARTBEAT_S
