"""The engine's prefix cache (engine/prefix_cache.py): what a request leaves behind is reused
by whoever continues it, lost least recently used first when allocations need the blocks, and
never holds back an admission. Hand-worked on the tiny profile (16-token blocks)."""

from __future__ import annotations

import random

import pytest

from tests.test_engine import tiny
from tokenpools.engine.model import Engine
from tokenpools.engine.prefix_cache import PrefixCache


def prefill_of_first_step(engine: Engine) -> int:
    return engine.step().prefill_tokens


def decode(engine: Engine, steps: int) -> None:
    for _ in range(steps):
        engine.step()


def test_only_whole_blocks_are_kept_and_one_token_is_always_computed() -> None:
    cache = PrefixCache(16)
    cache.keep("a", 15)  # less than a block: nothing reusable
    assert len(cache) == 0 and cache.blocks == 0
    cache.keep("a", 40)
    assert cache.blocks == 2 and cache.peek("a", 100) == 32
    assert cache.peek("a", 20) == 19  # the last prompt token's logits are computed again
    assert cache.peek("b", 100) == 0
    assert cache.take("a", 100) == 32
    assert len(cache) == 0 and cache.blocks == 0 and cache.hit_tokens == 32


def test_a_continuation_prefills_only_what_was_not_cached() -> None:
    engine = Engine(tiny())
    engine.add("r", 40, 100)
    assert prefill_of_first_step(engine) == 40
    decode(engine, 24)  # 25 tokens generated: 65 tokens of KV
    generated = engine.generated("r")
    assert generated == 25
    engine.abort("r")  # suspended: its 4 whole blocks (64 tokens) stay cached
    engine.add("r~1", 40 + generated, 100 - generated, prefix="r")
    assert prefill_of_first_step(engine) == 65 - 64
    assert engine.cache is not None and engine.cache.hit_tokens == 64


def test_without_prefix_caching_the_continuation_recomputes_everything() -> None:
    engine = Engine(tiny(prefix_caching=False))
    engine.add("r", 40, 100)
    decode(engine, 25)
    engine.abort("r")
    engine.add("r~1", 65, 75, prefix="r")
    assert prefill_of_first_step(engine) == 64  # the step's token budget; 65 in all
    assert engine.cache is None


def test_allocations_overwrite_the_least_recently_used_prefix_first() -> None:
    engine = Engine(tiny(kv_blocks=8, max_num_seqs=4))
    for name in ("old", "new"):  # 2 blocks each, kept in this order
        engine.add(name, 32, 1)
        engine.step()
    assert engine.cache is not None and engine.cache.blocks == 4
    engine.add("big", 80, 1)  # 6 blocks while it runs: needs 2 of the 4 cached ones
    while engine.has_work:
        engine.step()
    assert engine.cache.blocks == 2 + 5  # "new", and what "big" left
    engine.add("c-old", 40, 5, prefix="old")
    engine.add("c-new", 40, 5, prefix="new")
    # "big" finished and is the most recent now; "old" was overwritten, "new" survived
    result = engine.step()
    assert result.prefill_tokens == 40 + (40 - 32)


def test_a_preempted_request_reuses_its_own_blocks_when_scheduled_again() -> None:
    engine = Engine(tiny(kv_blocks=6, max_num_seqs=2, max_num_batched_tokens=64))
    engine.add("a", 40, 60)
    engine.add("b", 16, 60)
    prefills = [engine.step() for _ in range(40)]
    preempted = [r for r in prefills if r.preempted]
    assert preempted, "the KV-tight engine preempts"
    # whoever was preempted prefills its whole blocks from the cache when rescheduled:
    # no step after the first ever prefills a whole prompt again
    assert all(r.prefill_tokens < 40 for r in prefills[1:])


def test_cached_blocks_never_hold_back_an_admission() -> None:
    """The same arrivals with and without caches of dead requests filling every free block:
    the same steps."""
    rng = random.Random(7)
    shapes = [(rng.randint(8, 60), rng.randint(1, 30)) for _ in range(30)]

    def trace(warm: bool) -> list[tuple[int, int, int]]:
        engine = Engine(tiny(kv_blocks=20, max_num_seqs=3))
        if warm:  # three dead requests' KV fills the cache (their keys are never asked for)
            for i in range(3):
                engine.add(f"dead{i}", 100, 1)
                while engine.has_work:
                    engine.step()
            assert engine.cache is not None and engine.cache.blocks > 0
        for i, (p, o) in enumerate(shapes):
            engine.add(f"r{i}", p, o)
        out = []
        while engine.has_work:
            r = engine.step()
            out.append((r.prefill_tokens, r.decode_seqs, len(r.finished)))
        return out

    assert trace(warm=True) == trace(warm=False)


@pytest.mark.parametrize("seed", range(20))
def test_cache_and_running_kv_never_exceed_the_engine(seed: int) -> None:
    """Generated traces of arrivals, aborts and continuations: the cache holds only free
    blocks, and every request ends."""
    rng = random.Random(seed)
    engine = Engine(tiny(kv_blocks=rng.randint(6, 30)), rng.choice(["fcfs", "priority"]))
    live: dict[str, int] = {}
    for step in range(400):
        roll = rng.random()
        if roll < 0.15:
            name = f"r{step}"
            prompt = rng.randint(1, 70)
            priority = rng.randint(0, 2) if engine.scheduling_policy == "priority" else 0
            engine.add(name, prompt, rng.randint(1, 40), priority=priority)
            live[name] = prompt
        elif roll < 0.22 and live:
            name = rng.choice(sorted(live))
            generated = engine.generated(name)
            engine.abort(name)
            prompt = live.pop(name)
            if generated and rng.random() < 0.8:  # resumed
                again = f"{name}~"
                engine.add(again, prompt + generated, rng.randint(1, 20), prefix=name)
                live[again] = prompt + generated
        if engine.has_work:
            for seq in engine.step().finished:
                live.pop(seq.req_id, None)
        assert engine.cache is not None
        assert engine.cache.blocks <= max(0, engine.profile.kv_blocks - engine.kv_blocks_used())
    while engine.has_work:
        engine.step()
    assert engine.num_running == 0 and engine.kv_tokens == 0
