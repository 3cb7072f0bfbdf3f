"""What the engine keeps per request, and what one step reports."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Sequence:
    req_id: str
    tag: str  # who it belongs to (tenant), for per-tag accounting
    prompt_tokens: int
    output_tokens: int  # how many it will generate before it stops
    order: int  # arrival order; preemption takes the latest
    priority: int = 0  # vLLM's request priority: lower is served first (priority policy)
    generated: int = 0  # as of `base_step` while decoding
    computed: int = 0  # tokens with KV, as of `base_step` while decoding
    base_step: int = -1  # -1: not decoding
    preemptions: int = 0
    prefix: str = ""  # the prefix cache's key of what it continues ("": its own id)
    cached: int = 0  # prompt tokens served from the prefix cache when it last started

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class StepResult:
    duration_s: float
    prefill_tokens: int
    decode_seqs: int
    first_tokens: list[str] = field(default_factory=list)  # produced their first token
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


def by_priority_then_order(seq: Sequence) -> tuple[int, int]:
    """vLLM's order of requests under the priority policy (lower first; arrival breaks ties)."""
    return seq.priority, seq.order
