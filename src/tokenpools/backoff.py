"""How long to wait before trying again after attempts in a row without progress (pure): the
one backoff of every retry loop — the operator's watchers and its objects whose reconcile keeps
failing (k8s/retries.py: 1 s doubling to 5 min, no jitter), the usage ledger's flushes while
its database is away (usage/flusher.py), a budget notice's webhook (usage/notices.py).

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


def doubled(first_s: float, failures: int, max_s: float) -> float:
    """`first_s`, doubled for each failure in a row, at most `max_s`."""
    return float(min(max_s, first_s * 2 ** min(failures, 32)))


@dataclass
class Backoff:
    first_s: float = FIRST_S
    max_s: float = MAX_S
    jitter: Callable[[], float] = field(default=random.random)  # in [0, 1)
    failures: int = 0  # attempts in a row without progress

    def next(self) -> float:
        """The wait before the next attempt, counting this failure."""
        base = doubled(self.first_s, self.failures, self.max_s)
        self.failures += 1
        return float(min(self.max_s, base * (1 + JITTER * self.jitter())))

    def reset(self) -> None:
        self.failures = 0
