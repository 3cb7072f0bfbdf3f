"""One admitted request, from its admission to exactly one end: settled on its usage, released
(refunded, or charged its whole reservation), evicted by the core for higher-priority work, or
expired (its admission lease lost). Whatever the host, and however often it is told."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tokenpools.control.metering import Charge
from tokenpools.control.store import Lease
from tokenpools.model.request import Usage
from tokenpools.openai_api.answer_tap import AnswerTap

EndFn = Callable[["Admitted", Usage | None, bool], None]
RechargeFn = Callable[["Admitted", Usage], None]


class Cancellable(Protocol):
    """What a host hands admission to stop a request the core evicts: its task, or one that
    cancels it only where that is safe (the ext_proc stream's `Waker`)."""

    def cancel(self) -> bool: ...


class Admitted:
    def __init__(
        self,
        lease: Lease,
        task: Cancellable | None,
        on_end: EndFn,
        on_recharge: RechargeFn | None = None,
    ) -> None:
        self.lease = lease
        self.task = task  # cancelled on eviction; without one, the host checks `evicted`
        self._on_end = on_end
        self._on_recharge = on_recharge
        self.recharged = False
        self.ended = False  # settled or released by its host
        self.evicted = False  # ended by the core (eviction, expiry); the host stops serving it
        self.charge: Charge | None = None  # what its usage cost, once settled (if metered)
        self.usage: Usage | None = None  # what it was settled on (None: released, or not yet)

    @property
    def over(self) -> bool:
        return self.ended or self.evicted

    def end(self, usage: Usage | None, refund: bool = True) -> bool:
        """Settle on `usage`, or release (None: refund, or charge the whole reservation).
        Only the first end counts; after an eviction the lease has already ended."""
        if self.over:
            return False
        self.ended = True
        self.usage = usage
        self._on_end(self, usage, refund)
        return True

    def abandon(self, tap: AnswerTap | None, prompt_tokens: int) -> bool:
        """The client went away, or the connection broke, before the answer's end: charged
        what streamed (the engine's count if it gave one), or, before anything streamed, the
        whole reservation (the engine may have worked on it)."""
        if tap is not None and (tap.streamed > 0 or tap.usage is not None):
            return self.end(tap.so_far(prompt_tokens), refund=False)
        return self.end(None, refund=False)

    def close(self) -> None:
        """The host is done with it: a request that never ended is charged in full (its
        usage is unknown), so nothing stays held."""
        self.end(None, refund=False)

    def recharge(self, usage: Usage) -> bool:
        """Evicted, so charged its whole reservation, and then suspended: once its host knows
        what its client received of it, it is charged that instead, once (`usage` becomes
        that; a store that does not answer keeps the reservation charged, not retried)."""
        if not self.evicted or self.recharged or self._on_recharge is None:
            return False
        self.recharged = True
        self.usage = usage
        self._on_recharge(self, usage)
        return True

    def evict(self) -> None:
        if self.over:
            return
        self.evicted = True
        if self.task is not None:
            self.task.cancel()
