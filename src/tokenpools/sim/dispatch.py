"""The dispatch cycle of a policy that holds requests in queues of its own (llm-d's flow
control): release queued attempts to the engines until the policy releases none, then act on
what it decided besides (refusals, evictions, a later cycle it asks for)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenpools.sim.simulator import Simulation


class Dispatcher:
    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self._wakes: set[float] = set()  # dispatch cycles the policy asked for

    def cycle(self) -> None:
        """Ask the policy for queued attempts until it releases none (it may release one at a
        time and read the engines again), then act on what it decided besides."""
        sim = self.sim
        while released := sim.policy.dispatch(sim.now, sim.free_slots):
            for req in released:
                sim.to_engine(req)
        self.aftermath()

    def aftermath(self) -> None:
        sim = self.sim
        after = sim.policy.aftermath(sim.now)
        for req_id, reason in after.refuse:
            sim.clients.refused_in_queue(req_id, reason)
        for req_id in after.evict:
            sim.evict(req_id)
        if after.evict or after.refuse:  # room was made: the policy may release more
            self.cycle()
        elif after.wake_at is not None and after.wake_at not in self._wakes:
            self._wakes.add(after.wake_at)  # one wake-up per instant, however often asked
            sim.at(after.wake_at, partial(self._wake, after.wake_at))

    def _wake(self, at: float) -> None:
        self._wakes.discard(at)
        self.cycle()
