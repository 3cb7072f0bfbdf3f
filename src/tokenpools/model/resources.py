"""The three inference-native resources of a token pool, as one vector type."""

from __future__ import annotations

from dataclasses import dataclass

# The dimensions' names where hosts show them (admin API, metrics labels, dashboard), in
# `as_tuple` order.
DIMENSIONS = ("tokens_per_s", "kv_tokens", "concurrency")


@dataclass(frozen=True, slots=True)
class Resources:
    """A vector over the pool's three dimensions.

    `throughput` is tokens per second for a capacity or an entitlement, and tokens for the
    cost of one request; `kv_tokens` is KV-cache capacity counted in tokens (bytes are converted
    at the edge with the pool's ModelProfile); `concurrency` counts in-flight sequences.
    """

    throughput: float = 0.0
    kv_tokens: float = 0.0
    concurrency: float = 0.0

    # Written out: mypyc compiles it, where the one @dataclass generates runs interpreted
    # (control/store_terms.py says more, above Lease).
    def __init__(
        self, throughput: float = 0.0, kv_tokens: float = 0.0, concurrency: float = 0.0
    ) -> None:
        object.__setattr__(self, "throughput", throughput)
        object.__setattr__(self, "kv_tokens", kv_tokens)
        object.__setattr__(self, "concurrency", concurrency)

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.throughput + other.throughput,
            self.kv_tokens + other.kv_tokens,
            self.concurrency + other.concurrency,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.throughput - other.throughput,
            self.kv_tokens - other.kv_tokens,
            self.concurrency - other.concurrency,
        )

    def scale(self, factor: float) -> Resources:
        return Resources(
            self.throughput * factor, self.kv_tokens * factor, self.concurrency * factor
        )

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.throughput, self.kv_tokens, self.concurrency)

    def as_dict(self) -> dict[str, float]:
        return dict(zip(DIMENSIONS, self.as_tuple(), strict=True))

    def is_nonnegative(self) -> bool:
        return self.throughput >= 0 and self.kv_tokens >= 0 and self.concurrency >= 0

    def max_ratio(self, base: Resources) -> float:
        """max over dimensions of self/base, skipping dimensions where base is zero."""
        ratios = [
            mine / theirs
            for mine, theirs in zip(self.as_tuple(), base.as_tuple(), strict=True)
            if theirs > 0
        ]
        return max(ratios, default=0.0)
