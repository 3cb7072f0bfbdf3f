"""The engine's waiting queue, one per scheduling policy, as vLLM v1 keeps it
(vllm/v1/core/sched/request_queue.py: FCFSRequestQueue, PriorityRequestQueue).

fcfs: a deque; arrivals at the back, a preempted request back at the front (`prepend_request`).
priority: a heap ordered by (priority, arrival), lower first; a preempted request goes back in
by its own (priority, arrival) — a heap has no front (PriorityRequestQueue.prepend_request).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from tokenpools.engine.sequence import Sequence, by_priority_then_order
from tokenpools.model.pool import SchedulingPolicy

__all__ = ["FcfsQueue", "PriorityQueue", "SchedulingPolicy", "priority_refusal"]


def priority_refusal(policy: SchedulingPolicy, priority: int) -> str | None:
    """Why an engine refuses a request's priority, in vLLM's words (None: it does not). vLLM
    documents the refusal of any priority but 0 without --scheduling-policy priority (the
    `priority` field of its OpenAI protocol); its v0 engine raised this, its v1 ignores it."""
    if priority != 0 and policy != "priority":
        return f"Got priority {priority} but Priority scheduling is not enabled."
    return None


class FcfsQueue(deque[Sequence]):
    """First come, first served: the deque's own methods under the queue's names, so the
    fcfs engine pays nothing for the indirection."""

    add = deque.append
    prepend = deque.appendleft
    pop_next = deque.popleft

    def peek(self) -> Sequence:
        return self[0]


class PriorityQueue:
    """(priority, arrival) order; arrival order is unique, so sequences are never compared."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Sequence]] = []

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.priority, seq.order, seq))

    prepend = add  # a preempted request goes back by its own (priority, arrival)

    def peek(self) -> Sequence:
        return self._heap[0][2]

    def pop_next(self) -> Sequence:
        return heapq.heappop(self._heap)[2]

    def remove(self, seq: Sequence) -> None:
        """O(n), as vLLM's: only an abort of a waiting request comes here."""
        self._heap = [entry for entry in self._heap if entry[2] is not seq]
        heapq.heapify(self._heap)

    def __contains__(self, seq: object) -> bool:
        return any(entry[2] is seq for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """In serving order (a sorted copy: for tests and inspection, not for the step)."""
        return iter(sorted((entry[2] for entry in self._heap), key=by_priority_then_order))
