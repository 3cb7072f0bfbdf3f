"""The simulation's clock and its queue of future events.

Deterministic: events at one instant run in the order they were scheduled, except that an
event scheduled `first` (a tenant joining) runs before the others at its instant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Timeline:
    def __init__(self) -> None:
        self.now = 0.0
        # (time, rank, sequence, action): at one instant rank 0 goes first, then the rest in
        # the order scheduled; the sequence keeps actions from ever being compared.
        self._heap: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, action: Callable[[], None], first: bool = False) -> None:
        """Run `action` at time t (virtual seconds)."""
        heapq.heappush(self._heap, (t, 0 if first else 1, next(self._seq), action))

    def run(self, end: float, progress: Callable[[float], None] | None = None) -> None:
        """Run events in time order until none is left or the next is after `end`; the clock
        then reads `end`. `progress` hears the clock at most once per simulated second."""
        next_report = 0.0
        while self._heap:
            t, _, _, action = heapq.heappop(self._heap)
            if t > end:
                break
            self.now = t
            action()
            if progress is not None and t >= next_report:
                progress(t)
                next_report = t + 1.0
        self.now = end
