"""How long to wait before trying again after attempts in a row without progress (pure): the
operator's one backoff, for its watchers and for an object whose reconcile keeps failing
(reconciler.py: 1 s doubling to 5 min, no jitter).

A watch that keeps failing — an error, a 410 Gone after every relist, a stream that ends as
soon as it opens — must not turn into a tight list-and-watch loop against the API server: each
attempt in a row without progress waits twice as long as the one before (1 s doubling to 30 s,
as client-go's reflector backs off), with up to a fifth added at random so that many replicas
cut off together do not come back together. Progress (an event, or a watch that ran its
course) starts it over. The random source is injected."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_S, MAX_S, JITTER = 1.0, 30.0, 0.2


@dataclass
class Backoff:
    first_s: float = FIRST_S
    max_s: float = MAX_S
    jitter: Callable[[], float] = field(default=random.random)  # in [0, 1)
    failures: int = 0  # attempts in a row without progress

    def next(self) -> float:
        """The wait before the next attempt, counting this failure."""
        base = min(self.max_s, self.first_s * 2 ** min(self.failures, 32))
        self.failures += 1
        return float(min(self.max_s, base * (1 + JITTER * self.jitter())))

    def reset(self) -> None:
        self.failures = 0
