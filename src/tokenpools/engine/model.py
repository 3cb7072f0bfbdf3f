"""A vLLM-like engine: continuous batching, paged KV cache, chunked prefill, recompute
preemption. It has no clock: `step()` schedules one engine step and says how long it takes;
the host (simulator or emulator) lets that time pass however it likes.

Decoding sequences are not touched one by one each step: each advances one token per step, so
a sequence's progress is derived from the step counter, and finishes come off a heap. That
keeps a step O(1) plus its events, whatever the batch size.

KV accounting is per sequence in tokens; blocks are counted as ⌈tokens/16⌉ per sequence,
bounded from above by (Σ tokens + 15·n)/16 so the check is O(1). The bound can preempt up to one
block per sequence earlier than vLLM would — a documented approximation.

The scheduling policy is vLLM's `--scheduling-policy` (vllm/v1/core/sched/scheduler.py):
"fcfs" (the default) serves the waiting queue in arrival order and preempts the latest arrival;
"priority" serves it by (priority, arrival), lower first, and preempts the running request with
the largest (priority, arrival). Either way only a running request that cannot get KV blocks
preempts; a waiting one waits (docs/simulation.md, "The engine's scheduling policy").

With prefix caching on (vLLM v1's default), the KV a request leaves behind stays cached in the
free blocks until allocations overwrite it (engine/prefix_cache.py): a request that continues
it (a resumed request, a preempted one scheduled again) prefills only what was lost.
"""

from __future__ import annotations

import heapq
from collections import Counter
from operator import attrgetter

from tokenpools.engine.prefix_cache import PrefixCache
from tokenpools.engine.profile import EngineProfile
from tokenpools.engine.queues import (
    FcfsQueue,
    PriorityQueue,
    SchedulingPolicy,
    priority_refusal,
)
from tokenpools.engine.sequence import Sequence, StepResult, by_priority_then_order
from tokenpools.engine.tag_tokens import TagTokens
from tokenpools.model.pool import SCHEDULING_POLICIES

__all__ = ["Engine", "Sequence", "StepResult"]  # the engine's face: what a step reports


class Engine:
    def __init__(
        self, profile: EngineProfile, scheduling_policy: SchedulingPolicy = "fcfs"
    ) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"Unknown scheduling policy: {scheduling_policy}")
        self.profile = profile
        self.scheduling_policy = scheduling_policy
        self._priority = scheduling_policy == "priority"
        self.step_count = 0
        self._order = 0
        self.waiting: FcfsQueue | PriorityQueue = PriorityQueue() if self._priority else FcfsQueue()
        # The preemption victim is the max of this over the running requests. In fcfs every
        # priority is 0 (`add` refuses others), so (priority, order) and order agree there.
        self._victim_key = by_priority_then_order if self._priority else attrgetter("order")
        self._prefilling: list[Sequence] = []  # running, KV not yet complete
        self._decoding: dict[str, Sequence] = {}
        self._finish_heap: list[tuple[int, int, str]] = []  # (step it finishes at, order, id)
        self._seqs: dict[str, Sequence] = {}
        self.kv_tokens = 0  # Σ computed tokens of running sequences
        self.running_by_tag: Counter[str] = Counter()
        # Requests left waiting by the last schedule: what vLLM reports as
        # num_requests_waiting (arrivals since the step began are not counted yet).
        self.scheduled_waiting = 0
        self._tag_tokens = TagTokens()  # output tokens per tag (engine/tag_tokens.py)
        self.cache = PrefixCache(profile.block_size) if profile.prefix_caching else None

    # -- requests in and out ---------------------------------------------------------------

    def add(
        self,
        req_id: str,
        prompt_tokens: int,
        output_tokens: int,
        tag: str = "",
        priority: int = 0,
        prefix: str = "",
    ) -> None:
        """`prefix`: the prefix-cache key of what the prompt continues (a resumed request's
        original); by default the request's own id (its own KV, should it be preempted)."""
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already in the engine")
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("a request needs at least one prompt and one output token")
        if refusal := priority_refusal(self.scheduling_policy, priority):
            raise ValueError(refusal)
        self._order += 1
        seq = Sequence(
            req_id,
            tag,
            prompt_tokens,
            output_tokens,
            self._order,
            priority,
            prefix=prefix or req_id,
        )
        self._seqs[req_id] = seq
        self.waiting.add(seq)

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
        sequences above the new limits are preempted by the victim rule (fcfs: latest first;
        priority: largest (priority, arrival) first); returns their ids."""
        self.profile = self.profile.model_copy(
            update={"max_num_seqs": max_num_seqs, "kv_blocks": kv_blocks}
        )
        result = StepResult(0.0, 0, 0)
        while self.num_running > max_num_seqs or (
            self.num_running and self.kv_blocks_used() > kv_blocks
        ):
            self._preempt(self._victim(), result)
        if self.cache is not None:
            self.cache.trim(kv_blocks - self.kv_blocks_used())
        return result.preempted

    def output_tokens_by_tag(self) -> dict[str, int]:
        """Output tokens generated so far, per tag."""
        return self._tag_tokens.totals(self.step_count)

    def sequence(self, req_id: str) -> Sequence | None:
        """A request the engine holds (read-only: the engine's own record)."""
        return self._seqs.get(req_id)

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
        # Decoding sequences each need one more KV slot; make room by preempting victims.
        while self._decoding and self.kv_blocks_used(len(self._decoding)) > total_blocks:
            self._preempt(self._victim(), result)
        budget = profile.max_num_batched_tokens - len(self._decoding)
        chunks: list[tuple[Sequence, int]] = []
        extra_tokens = len(self._decoding)
        if self._priority:
            chunks, budget, extra_tokens = self._prefill_by_priority(result, budget, extra_tokens)
        else:  # fcfs, exactly as before priority mode existed (the experiments depend on it)
            for seq in list(self._prefilling):
                if budget <= 0:
                    break
                chunk = min(seq.total_tokens - seq.computed, budget)
                while self.kv_blocks_used(extra_tokens + chunk) > total_blocks:
                    if not self._preempt(self._victim(keep=seq), result):  # never the asker
                        chunk = 0
                        break
                if seq.req_id not in self._seqs or chunk <= 0:
                    continue
                chunks.append((seq, chunk))
                extra_tokens += chunk
                budget -= chunk
        if not result.preempted:
            headroom = total_blocks * (1.0 - profile.watermark)
            waiting = self.waiting
            cache = self.cache
            while waiting and self.num_running < profile.max_num_seqs and budget > 0:
                seq = waiting.peek()
                hit = 0 if cache is None else cache.peek(seq.prefix, seq.total_tokens)
                chunk = min(seq.total_tokens - hit, budget)
                if self.kv_blocks_used(extra_tokens + hit + chunk, 1) > headroom:
                    break  # the head waits, and so does everything behind it (as in vLLM)
                waiting.pop_next()
                if cache is not None:  # its cached blocks are in use again
                    seq.computed = seq.cached = cache.take(seq.prefix, seq.total_tokens)
                    self.kv_tokens += seq.computed
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
                self._tag_tokens.sampled(seq.tag)
                if seq.generated >= seq.output_tokens:
                    self._finish(seq, result)
                else:
                    self._prefilling.remove(seq)
                    seq.base_step = step
                    self._decoding[seq.req_id] = seq
                    self._tag_tokens.started_decoding(seq.tag, step)
                    finish_at = step + seq.output_tokens - seq.generated
                    heapq.heappush(self._finish_heap, (finish_at, seq.order, seq.req_id))
        if self.cache is not None:  # this step's allocations overwrite cached blocks
            self.cache.trim(self.profile.kv_blocks - self.kv_blocks_used())
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

    def _prefill_by_priority(
        self, result: StepResult, budget: int, extra_tokens: int
    ) -> tuple[list[tuple[Sequence, int]], int, int]:
        """The prefilling sequences' chunks under vLLM's priority rules (scheduler.py, the
        RUNNING loop of `schedule`). A chunk that cannot get its KV blocks preempts the running
        request with the largest (priority, arrival) — which may be the one asking: then it is
        preempted and no further running request is scheduled this step. A victim already
        scheduled this step (a decode, an earlier chunk) gives its tokens back to the budget.
        Returns the chunks, the budget left and the tokens they and the decodes add."""
        chunks: dict[str, tuple[Sequence, int]] = {}
        for seq in list(self._prefilling):
            if budget <= 0:
                break
            if seq.req_id in result.preempted:
                continue  # preempted for an earlier chunk this step
            chunk = min(seq.total_tokens - seq.computed, budget)
            while self.kv_blocks_used(extra_tokens + chunk) > self.profile.kv_blocks:
                victim = self._victim()
                assert victim is not None  # `seq` itself is running
                if victim.req_id in self._decoding:
                    gives_back = 1  # its decode token
                else:  # its chunk, if it was scheduled before this one
                    gives_back = chunks.pop(victim.req_id, (victim, 0))[1]
                self._preempt(victim, result)
                if victim is seq:
                    return list(chunks.values()), budget, extra_tokens
                extra_tokens -= gives_back
                budget += gives_back
            chunks[seq.req_id] = (seq, chunk)
            extra_tokens += chunk
            budget -= chunk
        return list(chunks.values()), budget, extra_tokens

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
            self._tag_tokens.stopped_decoding(seq.tag, self.step_count)
        else:
            self._prefilling.remove(seq)
        self.running_by_tag[seq.tag] -= 1
        self._settle_progress(seq)
        self.kv_tokens -= seq.computed
        if self.cache is not None:  # its blocks are free, their contents kept
            self.cache.keep(seq.prefix, seq.computed)

    def _finish(self, seq: Sequence, result: StepResult) -> None:
        self._release(seq)
        del self._seqs[seq.req_id]
        result.finished.append(seq)

    def _victim(self, keep: Sequence | None = None) -> Sequence | None:
        """The running sequence to preempt (never `keep`): the latest arrival in fcfs, the
        largest (priority, arrival) in priority mode (scheduler.py: `max(self.running, ...)`)."""
        candidates = [s for s in (*self._prefilling, *self._decoding.values()) if s is not keep]
        return max(candidates, key=self._victim_key, default=None)

    def _preempt(self, victim: Sequence | None, result: StepResult) -> bool:
        """Preempt `victim` by recompute (scheduler.py, `_preempt_request`): its KV is freed and
        it goes back to the waiting queue (fcfs: the front; priority: by its own key) to
        prefill prompt + output so far. False when there is none to preempt."""
        if victim is None:
            return False
        self._release(victim)
        victim.computed = 0
        victim.preemptions += 1
        self.waiting.prepend(victim)
        result.preempted.append(victim.req_id)
        return True
