"""One admitted request, from its admission to exactly one end: settled on its usage, released
(refunded, or charged its whole reservation), evicted by the core for higher-priority work, or
expired (its admission lease lost). Whatever the host, and however often it is told."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tokenpools.control.metering import Charge
from tokenpools.control.store import Lease
from tokenpools.model.request import Usage

EndFn = Callable[["Admitted", Usage | None, bool], None]


class Admitted:
    def __init__(self, lease: Lease, task: asyncio.Task[Any] | None, on_end: EndFn) -> None:
        self.lease = lease
        self.task = task  # cancelled on eviction; without one, the host checks `evicted`
        self._on_end = on_end
        self.ended = False  # settled or released by its host
        self.evicted = False  # ended by the core (eviction, expiry); the host stops serving it
        self.charge: Charge | None = None  # what its usage cost, once settled (if metered)

    @property
    def over(self) -> bool:
        return self.ended or self.evicted

    def end(self, usage: Usage | None, refund: bool = True) -> bool:
        """Settle on `usage`, or release (None: refund, or charge the whole reservation).
        Only the first end counts; after an eviction the lease has already ended."""
        if self.over:
            return False
        self.ended = True
        self._on_end(self, usage, refund)
        return True

    def close(self) -> None:
        """The host is done with it: a request that never ended is charged in full (its
        usage is unknown), so nothing stays held."""
        self.end(None, refund=False)

    def evict(self) -> None:
        if self.over:
            return
        self.evicted = True
        if self.task is not None:
            self.task.cancel()
