"""The memory store's accounts: token buckets, one account per entitlement and per pool, and
the pool's check-5 bookkeeping (recent refusals, the lowest priority in flight)."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from tokenpools.control.store import INF, BucketSpec, Lease, PoolCounters, Window


class Bucket:
    __slots__ = ("depth", "level", "rate", "t")

    def __init__(self, spec: BucketSpec, now: float) -> None:
        self.rate = spec.rate
        self.depth = spec.depth
        self.level = spec.depth
        self.t = now

    def refill(self, now: float) -> None:
        dt = now - self.t
        if dt > 0:
            self.t = now
            level = self.level + self.rate * dt
            self.level = level if level < self.depth else self.depth

    def reshape(self, spec: BucketSpec, now: float) -> None:
        """New rate and depth. Added depth arrives full (a new replica is idle and can work
        at once); on a shrink the level is only capped, keeping what was already spent."""
        self.refill(now)
        grown = spec.depth - self.depth
        self.rate, self.depth = spec.rate, spec.depth
        if grown > 0 and grown != INF:
            self.level += grown
        self.level = min(self.level, spec.depth)

    def credit(self, tokens: float, now: float) -> None:
        """Give back tokens (negative: charge more), never above the depth."""
        self.refill(now)
        self.level = min(self.depth, self.level + tokens)


# The key prefix of a refusal that counts in check 5 against work that is not lent only
# (`PoolAccount.note_refusal`); no entitlement name holds it.
RESERVED_ONLY = "\x1f"


def _counts(key: str, asker: str, lent: bool) -> bool:
    """Whether the refusal noted under `key` counts in check 5 against `asker`."""
    if key.startswith(RESERVED_ONLY):
        return not lent and key[1:] != asker
    return key != asker


class EntitlementAccount:
    __slots__ = (
        "admitted",
        "burst",
        "claimed_concurrency",
        "claimed_kv",
        "conc_seconds",
        "concurrency",
        "debt",
        "demand",
        "held_concurrency",
        "held_kv",
        "holdback_concurrency",
        "holdback_kv",
        "kv",
        "kv_seconds",
        "leases",
        "name",
        "own",
        "peak_concurrency",
        "peak_kv",
        "peak_recent_concurrency",
        "peak_recent_kv",
        "pool",
        "priority",
        "protected",
        "settled",
        "t_acc",
        "window_start",
    )

    def __init__(self, name: str, pool: str, own: Bucket, now: float) -> None:
        self.name, self.pool, self.own = name, pool, own
        self.protected = False
        self.holdback_concurrency = self.holdback_kv = 0.0  # its baseline, held back while unused
        self.held_concurrency = self.held_kv = 0.0  # what of it is held back now
        self.claimed_concurrency = self.claimed_kv = 0.0  # recent peak above what is in flight
        self.concurrency = self.kv = 0.0
        self.peak_concurrency = self.peak_kv = 0.0  # the most in flight this window
        self.leases = 0
        self.debt = self.burst = self.priority = 0.0
        self.peak_recent_concurrency = self.peak_recent_kv = 0.0  # scores
        self.t_acc = self.window_start = now
        self.conc_seconds = self.kv_seconds = self.settled = self.demand = 0.0
        self.admitted = 0.0

    def accumulate(self, now: float) -> None:
        dt = now - self.t_acc
        if dt > 0:
            self.conc_seconds += self.concurrency * dt
            self.kv_seconds += self.kv * dt
            self.t_acc = now

    def take_window(self, now: float) -> Window:
        """What the entitlement did since the last window, and a new window from now."""
        self.accumulate(now)
        window = Window(
            seconds=now - self.window_start,
            settled_tokens=self.settled,
            demand_tokens=self.demand,
            admitted_tokens=self.admitted,
            concurrency_seconds=self.conc_seconds,
            kv_seconds=self.kv_seconds,
            peak_concurrency=self.peak_concurrency,
            peak_kv=self.peak_kv,
        )
        self.window_start = now
        self.settled = self.demand = self.admitted = self.conc_seconds = self.kv_seconds = 0.0
        self.peak_concurrency, self.peak_kv = self.concurrency, self.kv
        return window


class PoolAccount:
    __slots__ = (
        "bucket",
        "claimed_concurrency",
        "claimed_kv",
        "claimed_sq_concurrency",
        "claimed_sq_kv",
        "concurrency",
        "held_concurrency",
        "held_kv",
        "inflight",
        "kv",
        "last_period",
        "leases",
        "low",
        "pre_concurrency",
        "pre_kv",
        "preemptible_by_ent",
        "protected",
        "protected_bucket",
        "reclaimable",
        "refused",
        "refused_top",
    )

    def __init__(self, bucket: Bucket, protected_bucket: Bucket) -> None:
        self.bucket, self.protected_bucket = bucket, protected_bucket
        self.concurrency = self.kv = self.pre_concurrency = self.pre_kv = 0.0
        self.held_concurrency = self.held_kv = 0.0
        self.claimed_concurrency = self.claimed_kv = 0.0  # Σ open claims (backfill.py)
        self.claimed_sq_concurrency = self.claimed_sq_kv = 0.0  # Σ of their squares
        self.leases = 0
        # Σ what taking back the lent work in flight would give back to the bucket
        # (control/eviction.py `refund_when_taken`): lent work may draw on the protected
        # share of the bucket, and the share counts it as there
        self.reclaimable = 0.0
        # entitlement → its in-flight leases on the shared path: the competitors of check 5.
        # Work inside a reserved baseline is not competing for shared capacity, so it neither
        # sets nor faces the threshold.
        self.inflight: dict[str, int] = {}
        # (priority, entitlement) of entitlements in flight, a lazy heap; None: rebuild it.
        self.low: list[tuple[float, str]] | None = None
        self.preemptible_by_ent: dict[str, dict[str, Lease]] = {}
        self.protected: set[str] = set()  # entitlements holding a reserved baseline
        # entitlement → (when it was last refused room, its priority then); the top of them
        self.refused: dict[str, tuple[float, float]] = {}
        self.refused_top: tuple[float, str, float] | None = None
        self.last_period = -1

    # -- check 5 ------------------------------------------------------------------------

    def counters(self, now: float) -> PoolCounters:
        self.bucket.refill(now)
        self.protected_bucket.refill(now)
        return PoolCounters(
            concurrency=self.concurrency,
            kv_tokens=self.kv,
            preemptible_concurrency=self.pre_concurrency,
            preemptible_kv=self.pre_kv,
            holdback_concurrency=self.held_concurrency,
            holdback_kv=self.held_kv,
            bucket=self.bucket.level,
            protected_bucket=self.protected_bucket.level,
            leases=self.leases,
            claimed_concurrency=self.claimed_concurrency,
            claimed_kv=self.claimed_kv,
            reclaimable_tokens=self.reclaimable,
        )

    def note_refusal(
        self, name: str, priority: float, now: float, reserved_only: bool = False
    ) -> None:
        """Remember that `name` was refused room: unmet demand, for check 5. `reserved_only`:
        work that is not lent, refused only for the room the unused protected baselines hold,
        which lent work may take and leave it no less; it counts against work that is not lent
        only, kept under its own key. The cached top stays the highest entry of the dict, or
        None (rebuilt when next asked)."""
        key = RESERVED_ONLY + name if reserved_only else name
        self.refused[key] = (now, priority)
        top = self.refused_top
        if top is None:
            return
        if priority >= top[0]:
            self.refused_top = (priority, key, now)
        elif top[1] == key:  # the top entry itself went down
            self.refused_top = None

    def forget_refusals(self, name: str) -> None:
        """`name` is gone (removed from the config): its refusals no longer count."""
        self.refused.pop(name, None)
        self.refused.pop(RESERVED_ONLY + name, None)
        self.refused_top = None

    def outranked(
        self,
        asker: str,
        w: float,
        since: float,
        ents: Mapping[str, EntitlementAccount],
        lent: bool = False,
    ) -> bool:
        """Check 5 for a request in a pool near full: refused when another entitlement of
        higher priority was refused room since `since` (its demand is unmet), and this one's
        priority is below the paper's threshold — the lowest priority in flight among the
        others — so the lowest-priority work in flight is what gives way. Demand-awareness
        keeps the pool work-conserving: nobody is shed for a tenant that wants nothing.

        The highest refusal is cached; the dict is scanned (dropping aged entries) when that
        one has aged out, or for the others' highest when it is the asker's own or one that
        does not count against it (a lent asker's: `note_refusal`'s `reserved_only`)."""
        top = self.refused_top
        if top is None or top[2] < since:
            top = None
            for name, (t, priority) in list(self.refused.items()):
                if t < since:
                    del self.refused[name]
                elif top is None or priority > top[0]:
                    top = (priority, name, t)
            self.refused_top = top
        if top is not None and not _counts(top[1], asker, lent):  # the highest of the others
            top = max(
                (
                    (pr, n, t)
                    for n, (t, pr) in self.refused.items()
                    if t >= since and _counts(n, asker, lent)
                ),
                default=None,
            )
        if top is None or top[0] <= w:
            return False
        return w < self.threshold(asker, ents)

    def threshold(self, name: str, ents: Mapping[str, EntitlementAccount]) -> float:
        """The lowest priority among *other* entitlements' shared-path leases in flight: a
        tenant never blocks itself, or check 5 could never fire for a tenant already served.

        A heap of (priority, entitlement) with lazy deletion: entries of entitlements no
        longer in flight are dropped when they reach the top. A priority change drops the
        whole heap (set_scores), so every entry carries its entitlement's current priority."""
        heap = self.low
        if heap is None or len(heap) > 2 * len(self.inflight) + 32:
            heap = self.low = [(ents[n].priority, n) for n in self.inflight]
            heapq.heapify(heap)
        inflight = self.inflight
        while heap and heap[0][1] not in inflight:
            heapq.heappop(heap)
        if not heap:
            return -INF
        if heap[0][1] != name:
            return heap[0][0]
        mine = []
        while heap and (heap[0][1] == name or heap[0][1] not in inflight):
            entry = heapq.heappop(heap)
            if entry[1] == name:
                mine.append(entry)
        threshold = heap[0][0] if heap else -INF
        for entry in mine:
            heapq.heappush(heap, entry)
        return threshold
