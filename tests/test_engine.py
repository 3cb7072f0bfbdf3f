"""The engine model: batching, chunked prefill, KV paging and preemption, abort, throughput."""

from __future__ import annotations

import pytest

from tokenpools.engine.model import Engine
from tokenpools.engine.profile import EngineProfile, ProfileError, builtin_profiles, load_profile


def tiny(**overrides: object) -> EngineProfile:
    base = {
        "name": "tiny",
        "description": "test",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "kv_blocks": 64,
        "block_size": 16,
        "watermark": 0.0,
        "t0_s": 0.01,
        "prefill_s_per_token": 0.001,
        "decode_s_per_seq": 0.002,
    }
    return EngineProfile.model_validate(base | overrides)


def run(engine: Engine, max_steps: int = 100_000) -> tuple[float, dict[str, float], int]:
    """Step until idle; returns elapsed time, first-token time per request, max running."""
    t, first, most = 0.0, {}, 0
    for _ in range(max_steps):
        if not engine.has_work:
            break
        r = engine.step()
        most = max(most, engine.num_running + len(r.finished))
        t += r.duration_s
        for req in r.first_tokens:
            first[req] = t
    return t, first, most


def test_builtin_profiles_load_and_the_paper_profile_matches_the_paper() -> None:
    assert {"paper-dgx-spark-qwen3-8b", "h100-llama3.1-8b", "a100-llama3.1-8b"} <= set(
        builtin_profiles()
    )
    profile = load_profile("paper-dgx-spark-qwen3-8b")
    engine = Engine(profile)
    for i in range(160):  # ten full batches of 64 in / 64 out
        engine.add(f"r{i}", 64, 64)
    elapsed, _, most = run(engine)
    assert most == 16
    assert 160 * 64 / elapsed == pytest.approx(240, rel=0.08)


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ProfileError, match="paper-dgx-spark-qwen3-8b"):
        load_profile("nope")


def test_continuous_batching_never_exceeds_the_slots_and_serves_fcfs() -> None:
    engine = Engine(tiny())
    for i in range(10):
        engine.add(f"r{i}", 16, 8)
    _, first, most = run(engine)
    assert most == 4
    order = sorted(first, key=lambda r: (first[r], int(r[1:])))
    assert order == [f"r{i}" for i in range(10)]


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    engine = Engine(tiny(max_num_batched_tokens=64, kv_blocks=1000))
    engine.add("long", 200, 2)
    steps = 0
    while True:
        r = engine.step()
        steps += 1
        assert r.prefill_tokens <= 64
        if r.first_tokens:
            break
    assert steps == 4  # 64 + 64 + 64 + 8 tokens


def test_kv_exhaustion_preempts_the_latest_arrival_which_still_completes() -> None:
    # 16 blocks of 16 tokens = 256 tokens; four sequences growing to 100 tokens cannot all fit.
    engine = Engine(tiny(kv_blocks=16))
    for i in range(4):
        engine.add(f"r{i}", 20, 80)
    preempted: list[str] = []
    finished = []
    while engine.has_work:
        r = engine.step()
        preempted += r.preempted
        finished += [s.req_id for s in r.finished]
        assert engine.kv_blocks_used() <= 16
    assert preempted and preempted[0] == "r3"
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]


def test_abort_frees_the_slot_and_its_kv() -> None:
    engine = Engine(tiny())
    for i in range(5):
        engine.add(f"r{i}", 16, 50)
    engine.step()
    assert engine.num_running == 4 and engine.num_waiting == 1
    kv_before = engine.kv_tokens
    aborted = engine.abort("r0")
    assert aborted is not None and engine.kv_tokens < kv_before
    engine.step()
    assert engine.num_running == 4 and engine.num_waiting == 0
    assert engine.abort("r0") is None
    engine.add("r5", 16, 50)
    engine.step()
    assert engine.scheduled_waiting == 1
    assert engine.abort("r5") is not None  # a waiting one: the queue vLLM reports empties too
    assert engine.scheduled_waiting == 0
    assert engine.abort("r4") is not None  # running one
    while engine.has_work:
        engine.step()
    assert engine.kv_tokens == 0 and engine.num_running == 0


def test_resize_preempts_above_the_new_slots() -> None:
    engine = Engine(tiny())
    for i in range(4):
        engine.add(f"r{i}", 16, 50)
    engine.step()
    assert sorted(engine.resize(2, 64)) == ["r2", "r3"]
    assert engine.num_running == 2 and engine.num_waiting == 2


def test_output_tokens_per_tag_add_up() -> None:
    engine = Engine(tiny(kv_blocks=1000))
    for i in range(6):
        engine.add(f"r{i}", 16, 10 + i, tag="a" if i % 2 else "b")
    run(engine)
    counts = engine.output_tokens_by_tag()
    assert counts == {"a": 11 + 13 + 15, "b": 10 + 12 + 14}


def test_bad_requests_are_refused() -> None:
    engine = Engine(tiny())
    with pytest.raises(ValueError, match="at least one"):
        engine.add("x", 0, 5)
    engine.add("x", 1, 1)
    with pytest.raises(ValueError, match="already"):
        engine.add("x", 1, 1)


def test_a_sequence_preempted_one_token_before_its_end_recomputes_and_finishes() -> None:
    engine = Engine(tiny(kv_blocks=1000))
    engine.add("a", 8, 3)
    engine.step()  # prefill: first token
    engine.step()  # second token; one left
    assert engine.resize(0, 1000) == ["a"]  # preempted: its KV is recomputed later
    engine.resize(1, 1000)
    result = engine.step()  # re-prefill of prompt + 2 tokens samples the last token
    assert [s.req_id for s in result.finished] == ["a"]
    assert result.prefill_tokens == 10
    assert engine.kv_tokens == 0 and not engine.has_work
