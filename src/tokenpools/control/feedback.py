"""Capacity feedback: shrink a pool's effective capacity when its engines saturate anyway.

The capacity model can be wrong (longer prompts than assumed, a slower GPU, a noisy
neighbour); the engines' own queue says so. The control law is AIMD, as TCP's: when any
backend reports a waiting queue above `waiting_threshold` or KV usage at or above
`kv_threshold`, the effective capacity is multiplied by (1 − decrease), down to `min_fraction`
of the configured one; when no backend waits and KV is below the threshold, it grows back by
`increase` per interval. Fast retreat, slow return — the queue is what hurts latency.
"""

from __future__ import annotations

from tokenpools.model.pool import CapacityFeedback


def next_fraction(current: float, waiting: float, kv_usage: float, fb: CapacityFeedback) -> float:
    if waiting > fb.waiting_threshold or kv_usage >= fb.kv_threshold:
        return max(fb.min_fraction, current * (1.0 - fb.decrease))
    if waiting == 0 and kv_usage < fb.kv_threshold:
        return min(1.0, current + fb.increase)
    return current
