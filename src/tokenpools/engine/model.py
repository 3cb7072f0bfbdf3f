"""A vLLM-like engine: continuous batching, paged KV cache, chunked prefill, recompute
preemption. It has no clock: `step()` schedules one engine step and says how long it takes;
the host (simulator or emulator) lets that time pass however it likes.

Decoding sequences are not touched one by one each step: each advances one token per step, so
a sequence's progress is derived from the step counter, and finishes come off a heap. That
keeps a step O(1) plus its events, whatever the batch size.

KV accounting is per sequence in tokens; blocks are counted as ⌈tokens/16⌉ per sequence,
bounded from above by (Σ tokens + 15·n)/16 so the check is O(1). The bound can preempt up to one
block per sequence earlier than vLLM would — a documented approximation.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

from tokenpools.engine.profile import EngineProfile


@dataclass(slots=True)
class Sequence:
    req_id: str
    tag: str  # who it belongs to (tenant), for per-tag accounting
    prompt_tokens: int
    output_tokens: int  # how many it will generate before it stops
    order: int  # arrival order; preemption takes the latest
    generated: int = 0  # as of `base_step` while decoding
    computed: int = 0  # tokens with KV, as of `base_step` while decoding
    base_step: int = -1  # -1: not decoding
    preemptions: int = 0

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


class Engine:
    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self.step_count = 0
        self._order = 0
        self.waiting: deque[Sequence] = deque()
        self._prefilling: list[Sequence] = []  # running, KV not yet complete
        self._decoding: dict[str, Sequence] = {}
        self._finish_heap: list[tuple[int, int, str]] = []  # (step it finishes at, order, id)
        self._seqs: dict[str, Sequence] = {}
        self.kv_tokens = 0  # Σ computed tokens of running sequences
        self.running_by_tag: Counter[str] = Counter()
        # Requests left waiting by the last schedule: what vLLM reports as
        # num_requests_waiting (arrivals since the step began are not counted yet).
        self.scheduled_waiting = 0
        self.decoding_by_tag: Counter[str] = Counter()
        # Output tokens per tag, folded in lazily: a tag's decoding sequences each add one
        # token per step, so only changes of their number need bookkeeping.
        self._tokens_by_tag: Counter[str] = Counter()
        self._tag_since: dict[str, int] = {}

    # -- requests in and out ---------------------------------------------------------------

    def add(self, req_id: str, prompt_tokens: int, output_tokens: int, tag: str = "") -> None:
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already in the engine")
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("a request needs at least one prompt and one output token")
        self._order += 1
        seq = Sequence(req_id, tag, prompt_tokens, output_tokens, self._order)
        self._seqs[req_id] = seq
        self.waiting.append(seq)

    def abort(self, req_id: str) -> Sequence | None:
        """Drop a request wherever it is, freeing its slot and KV blocks."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.scheduled_waiting = min(self.scheduled_waiting, len(self.waiting))
        else:
            self._release(seq)
        return seq

    def resize(self, max_num_seqs: int, kv_blocks: int) -> list[str]:
        """Change the engine's capacity at once (a replica losing or regaining GPUs). Running
        sequences above the new limits are preempted, latest first; returns their ids."""
        self.profile = self.profile.model_copy(
            update={"max_num_seqs": max_num_seqs, "kv_blocks": kv_blocks}
        )
        result = StepResult(0.0, 0, 0)
        while self.num_running > max_num_seqs or (
            self.num_running and self.kv_blocks_used() > kv_blocks
        ):
            self._preempt_latest(result)
        return result.preempted

    def output_tokens_by_tag(self) -> dict[str, int]:
        """Output tokens generated so far, per tag."""
        for tag in list(self._tag_since):
            self._fold_tokens(tag)
        return dict(self._tokens_by_tag)

    def _fold_tokens(self, tag: str) -> None:
        since = self._tag_since.get(tag, self.step_count)
        self._tokens_by_tag[tag] += self.decoding_by_tag[tag] * (self.step_count - since)
        self._tag_since[tag] = self.step_count

    def generated(self, req_id: str) -> int:
        seq = self._seqs.get(req_id)
        return 0 if seq is None else self._generated(seq)

    # -- state -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._seqs)

    def kv_blocks_used(self, extra_tokens: int = 0, extra_seqs: int = 0) -> int:
        n = self.num_running + extra_seqs
        return (self.kv_tokens + extra_tokens + (self.profile.block_size - 1) * n) // (
            self.profile.block_size
        )

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_blocks_used() / self.profile.kv_blocks)

    # -- one step --------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule one step at the current state and apply its effects; the host lets
        `duration_s` pass before it looks at the outputs."""
        profile = self.profile
        result = StepResult(0.0, 0, 0)
        total_blocks = profile.kv_blocks
        # Decoding sequences each need one more KV slot; make room by preempting the latest.
        while self._decoding and self.kv_blocks_used(len(self._decoding)) > total_blocks:
            self._preempt_latest(result)
        budget = profile.max_num_batched_tokens - len(self._decoding)
        chunks: list[tuple[Sequence, int]] = []
        extra_tokens = len(self._decoding)
        for seq in list(self._prefilling):
            if budget <= 0:
                break
            chunk = min(seq.total_tokens - seq.computed, budget)
            while self.kv_blocks_used(extra_tokens + chunk) > total_blocks:
                if not self._preempt_latest(result, keep=seq):
                    chunk = 0
                    break
            if seq.req_id not in self._seqs or chunk <= 0:
                continue
            chunks.append((seq, chunk))
            extra_tokens += chunk
            budget -= chunk
        if not result.preempted:
            headroom = total_blocks * (1.0 - profile.watermark)
            while self.waiting and self.num_running < profile.max_num_seqs and budget > 0:
                seq = self.waiting[0]
                chunk = min(seq.total_tokens - seq.computed, budget)
                if self.kv_blocks_used(extra_tokens + chunk, 1) > headroom:
                    break
                self.waiting.popleft()
                self._prefilling.append(seq)
                self.running_by_tag[seq.tag] += 1
                chunks.append((seq, chunk))
                extra_tokens += chunk
                budget -= chunk

        self.scheduled_waiting = len(self.waiting)
        decode_seqs = len(self._decoding)
        prefill_tokens = sum(chunk for _, chunk in chunks)
        result.duration_s = profile.step_time(prefill_tokens, decode_seqs, self.kv_tokens)
        result.prefill_tokens, result.decode_seqs = prefill_tokens, decode_seqs

        self.step_count += 1
        step = self.step_count
        self.kv_tokens += decode_seqs + prefill_tokens
        for seq, chunk in chunks:
            seq.computed += chunk
            if seq.computed == seq.total_tokens:  # prefill done: the step samples a token
                if seq.generated == 0:
                    result.first_tokens.append(seq.req_id)
                seq.generated += 1
                self._tokens_by_tag[seq.tag] += 1
                if seq.generated >= seq.output_tokens:
                    self._finish(seq, result)
                else:
                    self._prefilling.remove(seq)
                    seq.base_step = step
                    self._decoding[seq.req_id] = seq
                    self._fold_tokens(seq.tag)
                    self.decoding_by_tag[seq.tag] += 1
                    finish_at = step + seq.output_tokens - seq.generated
                    heapq.heappush(self._finish_heap, (finish_at, seq.order, seq.req_id))
        heap = self._finish_heap
        while heap and heap[0][0] <= step:
            _, order, req_id = heapq.heappop(heap)
            done = self._decoding.get(req_id)
            if (
                done is not None
                and done.order == order
                and self._generated(done) >= done.output_tokens
            ):
                self._finish(done, result)
        return result

    # -- internals -------------------------------------------------------------------------

    def _generated(self, seq: Sequence) -> int:
        if seq.base_step < 0:
            return seq.generated
        return seq.generated + (self.step_count - seq.base_step)

    def _computed(self, seq: Sequence) -> int:
        if seq.base_step < 0:
            return seq.computed
        return seq.computed + (self.step_count - seq.base_step)

    def _settle_progress(self, seq: Sequence) -> None:
        """Fold the steps a decoding sequence took into its own counters."""
        if seq.base_step >= 0:
            seq.generated, seq.computed = self._generated(seq), self._computed(seq)
            seq.base_step = -1

    def _release(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch and free its KV."""
        if seq.req_id in self._decoding:
            del self._decoding[seq.req_id]
            self._fold_tokens(seq.tag)
            self.decoding_by_tag[seq.tag] -= 1
        else:
            self._prefilling.remove(seq)
        self.running_by_tag[seq.tag] -= 1
        self._settle_progress(seq)
        self.kv_tokens -= seq.computed

    def _finish(self, seq: Sequence, result: StepResult) -> None:
        self._release(seq)
        del self._seqs[seq.req_id]
        result.finished.append(seq)

    def _preempt_latest(self, result: StepResult, keep: Sequence | None = None) -> bool:
        """Preempt by recompute the latest-arrived running sequence (never `keep`): its KV is
        freed and it goes back to the front of the queue to prefill prompt + output so far."""
        candidates = [s for s in (*self._prefilling, *self._decoding.values()) if s is not keep]
        if not candidates:
            return False
        victim = max(candidates, key=lambda s: s.order)
        self._release(victim)
        victim.computed = 0
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        result.preempted.append(victim.req_id)
        return True
