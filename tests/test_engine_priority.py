"""vLLM v1's --scheduling-policy in the engine model, pinned to hand-worked traces on a tiny
engine: 16-token blocks, a few of them, a handful of slots, no watermark.

priority (vllm/v1/core/sched/request_queue.py, scheduler.py): the waiting queue is served by
(priority, arrival), lower first; only a running request that cannot get KV blocks preempts,
and the victim is the running request with the largest (priority, arrival), possibly the one
asking; a victim recomputes from scratch and goes back into the queue by its own key.
fcfs: arrival order, the latest arrival preempted; a non-zero priority refused."""

from __future__ import annotations

import pytest

from tests.test_engine import tiny
from tokenpools.engine.model import Engine
from tokenpools.engine.profile import EngineProfile
from tokenpools.engine.queues import SchedulingPolicy
from tokenpools.sim.policy import SimRequest
from tokenpools.sim.replicas import Replicas
from tokenpools.sim.scenario import Scenario
from tokenpools.sim.simulator import Simulation

Step = tuple[int, int, list[str], list[str], list[str]]


def steps(engine: Engine, n: int) -> list[Step]:
    """(prefill tokens, decoding sequences, first tokens, finished, preempted) per step."""
    out = []
    for _ in range(n):
        r = engine.step()
        finished = [s.req_id for s in r.finished]
        out.append((r.prefill_tokens, r.decode_seqs, r.first_tokens, finished, r.preempted))
    return out


def first_token_order(engine: Engine) -> list[str]:
    order = []
    while engine.has_work:
        order += engine.step().first_tokens
    return order


def test_the_waiting_queue_is_served_by_priority_then_arrival() -> None:
    engine = Engine(tiny(max_num_seqs=1, kv_blocks=1000), "priority")
    for name, priority in [("a", 5), ("b", 1), ("c", 1), ("d", 0)]:
        engine.add(name, 8, 2, priority=priority)
    assert [s.req_id for s in engine.waiting] == ["d", "b", "c", "a"]
    assert first_token_order(engine) == ["d", "b", "c", "a"]


def test_a_high_priority_arrival_waits_for_a_slot_and_preempts_nothing() -> None:
    engine = Engine(tiny(max_num_seqs=2, kv_blocks=1000), "priority")
    engine.add("lo1", 16, 4, priority=10)
    engine.add("lo2", 16, 4, priority=10)
    assert steps(engine, 1) == [(32, 0, ["lo1", "lo2"], [], [])]
    engine.add("hi", 16, 4, priority=-5)
    # Both slots are held: hi waits while lo1 and lo2 decode their tokens 2 to 4; the step that
    # finishes them was scheduled with both running, so hi starts one step later.
    assert steps(engine, 4) == [
        (0, 2, [], [], []),
        (0, 2, [], [], []),
        (0, 2, [], ["lo1", "lo2"], []),
        (16, 0, ["hi"], [], []),
    ]


def test_a_high_priority_arrival_waits_for_kv_and_preempts_nothing() -> None:
    # 4 blocks = 64 tokens. lo holds 48 (3 blocks) and grows; hi's 32-token prompt would need
    # (48 + 1 + 32 + 2·15) / 16 = 6 blocks: it waits until lo is done, nothing is preempted.
    engine = Engine(tiny(kv_blocks=4), "priority")
    engine.add("lo", 48, 10, priority=10)
    assert steps(engine, 1) == [(48, 0, ["lo"], [], [])]
    engine.add("hi", 32, 2, priority=-5)
    trace = steps(engine, 10)
    assert trace[:8] == [(0, 1, [], [], [])] * 8
    assert trace[8:] == [(0, 1, [], ["lo"], []), (32, 0, ["hi"], [], [])]


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [
        ("priority", {"a": 5, "b": 5, "c": 0, "d": 0}, "b"),  # largest priority, then latest
        ("fcfs", {"a": 0, "b": 0, "c": 0, "d": 0}, "d"),  # the latest arrival
    ],
)
def test_a_decode_short_of_kv_preempts_the_largest_priority_then_arrival(
    policy: SchedulingPolicy, priorities: dict[str, int], victim: str
) -> None:
    # 8 blocks = 128 tokens. Four 16-token prompts fit; after k decodes the four decodes of
    # the next step need (64 + 4k + 4 + 4·15) / 16 blocks: 9 > 8 at k = 4, the sixth step.
    engine = Engine(tiny(kv_blocks=8), policy)
    for name, priority in priorities.items():
        engine.add(name, 16, 40, priority=priority)
    first, *decodes, sixth = steps(engine, 6)
    assert first[2] == (["c", "d", "a", "b"] if policy == "priority" else ["a", "b", "c", "d"])
    assert decodes == [(0, 4, [], [], [])] * 4
    assert sixth == (0, 3, [], [], [victim])
    assert [s.req_id for s in engine.waiting] == [victim]


def test_a_chunk_short_of_kv_preempts_the_asker_when_it_is_the_lowest_priority() -> None:
    # 6 blocks, 32 tokens a step. a (priority 0) decodes; b (priority 5) prefills 80 tokens:
    # 16, then 31, then its next 31 would need (64 + 1 + 31 + 2·15) / 16 = 7 blocks. The victim
    # is b itself (vLLM: `preempted_req == request`, and the running loop stops); a decodes on.
    engine = Engine(tiny(kv_blocks=6, max_num_batched_tokens=32), "priority")
    engine.add("a", 16, 50, priority=0)
    engine.add("b", 80, 5, priority=5)
    assert steps(engine, 3) == [
        (32, 0, ["a"], [], []),
        (31, 1, [], [], []),
        (0, 1, [], [], ["b"]),
    ]
    assert engine.kv_tokens == 18  # a's 16 + 2: b's 47 are gone


def test_in_fcfs_a_chunk_short_of_kv_preempts_the_latest_other_as_before() -> None:
    engine = Engine(tiny(kv_blocks=6, max_num_batched_tokens=32))
    engine.add("a", 16, 50)
    engine.add("b", 80, 5)
    assert steps(engine, 3)[2] == (31, 0, [], [], ["a"])


@pytest.mark.parametrize(
    ("policy", "victim"), [("priority", "a"), ("fcfs", "c")], ids=["priority", "fcfs"]
)
def test_a_chunk_short_of_kv_preempts_a_decode_by_priority_not_arrival(
    policy: SchedulingPolicy, victim: str
) -> None:
    # 7 blocks, 32 tokens a step. a (priority 5) and c (0) decode; b (0) prefills 64 tokens:
    # 30, then its next 30 would need (64 + 2 + 30 + 3·15) / 16 = 8 blocks. The victim is a,
    # which arrived first but has the largest priority (fcfs: c, the latest but b); it does not
    # decode that step.
    engine = Engine(tiny(kv_blocks=7, max_num_batched_tokens=32), policy)
    lowest = 5 if policy == "priority" else 0
    engine.add("a", 16, 50, priority=lowest)
    engine.add("c", 16, 50)
    steps(engine, 1)
    engine.add("b", 64, 5)
    assert steps(engine, 2) == [(30, 2, [], [], []), (30, 1, [], [], [victim])]


def test_a_preempted_request_recomputes_and_its_first_token_is_not_reported_again() -> None:
    engine = Engine(tiny(kv_blocks=1000), "priority")
    engine.add("a", 8, 5, priority=0)
    engine.add("b", 8, 5, priority=3)
    assert steps(engine, 2) == [(16, 0, ["a", "b"], [], []), (0, 2, [], [], [])]
    assert engine.resize(1, 1000) == ["b"]  # the victim rule: the largest priority
    assert engine.kv_tokens == 9  # b's 9 tokens of KV are dropped, a's remain
    assert engine.generated("b") == 2  # what it generated stays generated
    engine.resize(2, 1000)
    # b prefills its prompt and both generated tokens again (10) and samples its third token;
    # it is not a first token. Then both decode to 5.
    assert steps(engine, 3) == [
        (10, 1, [], [], []),
        (0, 2, [], [], []),
        (0, 2, [], ["a", "b"], []),
    ]


@pytest.mark.parametrize(
    ("policy", "preempted", "waiting"),
    [("priority", ["b", "c"], ["c", "b"]), ("fcfs", ["c", "b"], ["b", "c"])],
    ids=["priority", "fcfs"],
)
def test_resize_preempts_by_the_victim_rule_and_requeues_by_the_policy(
    policy: SchedulingPolicy, preempted: list[str], waiting: list[str]
) -> None:
    engine = Engine(tiny(kv_blocks=1000), policy)
    for name, priority in [("a", 0), ("b", 3), ("c", 1)]:
        engine.add(name, 8, 20, priority=priority if policy == "priority" else 0)
    engine.step()
    assert engine.resize(1, 1000) == preempted
    # priority: back into the heap by (priority, arrival); fcfs: each to the front
    assert [s.req_id for s in engine.waiting] == waiting


def test_an_aborted_waiting_request_leaves_the_heap_in_order() -> None:
    engine = Engine(tiny(max_num_seqs=1, kv_blocks=1000), "priority")
    for name, priority in [("run", 0), ("b", 2), ("c", 1), ("d", 3)]:
        engine.add(name, 8, 2, priority=priority)
    engine.step()
    assert engine.abort("c") is not None
    assert [s.req_id for s in engine.waiting] == ["b", "d"]
    assert first_token_order(engine) == ["b", "d"]


def test_fcfs_refuses_a_priority_as_vllm_says_and_unknown_policies_are_refused() -> None:
    engine = Engine(tiny())
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not enabled"):
        engine.add("x", 8, 2, priority=1)
    assert not engine.has_work
    engine.add("x", 8, 2, priority=0)
    with pytest.raises(ValueError, match="Unknown scheduling policy: sjf"):
        Engine(tiny(), "sjf")  # type: ignore[arg-type]


def test_fcfs_runs_the_trace_it_ran_before_priority_scheduling() -> None:
    """The steps with events of a KV-tight fcfs run without prefix caching, as the engine
    produced them before the scheduling policy and the prefix cache existed."""
    engine = Engine(tiny(kv_blocks=12, max_num_batched_tokens=48, prefix_caching=False))
    for i, (prompt, output) in enumerate([(40, 30), (20, 50), (60, 10), (30, 40), (10, 20)]):
        engine.add(f"r{i}", prompt, output)
    trace = steps(engine, 53)
    assert not engine.has_work
    events = {n: s for n, s in enumerate(trace, 1) if s[2] or s[3] or s[4]}
    assert events == {
        1: (48, 0, ["r0"], [], []),
        2: (47, 1, ["r1"], [], []),
        3: (46, 2, ["r2"], [], []),
        4: (9, 2, ["r3"], [], ["r2"]),
        6: (16, 2, [], [], ["r3"]),
        14: (0, 3, [], ["r2"], []),
        15: (42, 2, ["r4"], [], []),
        20: (0, 3, [], [], ["r4"]),
        30: (0, 2, [], ["r0"], ["r3"]),
        46: (0, 3, [], ["r4"], []),
        51: (0, 2, [], ["r1"], []),
        53: (0, 1, [], ["r3"], []),
    }


def _request(req_id: str, priority: int) -> SimRequest:
    return SimRequest(req_id, "t", "t", 8, 2, 2, 0.0, priority=priority)


def test_the_simulator_hands_a_priority_only_to_priority_engines() -> None:
    profile: EngineProfile = tiny(max_num_seqs=1)
    ranked = Replicas(profile, 1, "priority")
    for req_id, priority in [("a", 4), ("b", -2), ("c", 1)]:
        ranked.route(_request(req_id, priority))
    assert [s.req_id for s in ranked.engines[0].waiting] == ["b", "c", "a"]
    plain = Replicas(profile, 1)
    plain.route(_request("a", 4))  # a fcfs engine would refuse it: it is not sent
    assert [(s.req_id, s.priority) for s in plain.engines[0].waiting] == [("a", 0)]


def test_a_scenario_on_priority_engines_loads_and_runs() -> None:
    workload = {
        "arrivals": {"kind": "poisson", "rate": 2.0},
        "prompt": {"kind": "fixed", "value": 64},
        "output": {"kind": "fixed", "value": 32},
    }
    capacity = {"tokensPerSecond": 480, "kvTokens": 65536, "concurrency": 16}
    pool = {"name": "p", "model": "Qwen3-8B", "perReplica": capacity}
    data = {
        "name": "priority-engines", "duration_s": 20,
        "engine": {"profile": "paper-dgx-spark-qwen3-8b", "scheduling_policy": "priority"},
        "tokenpools": {"pools": [pool], "entitlements": [
            {"name": "a", "tenantId": "a", "pool": "p", "serviceClass": "guaranteed",
             "concurrency": 8}]},
        "tenants": [{"name": "a", "workload": workload}],
        "phases": [{"name": "all", "start_s": 0, "end_s": 20}],
    }  # fmt: skip
    scenario = Scenario.model_validate(data)
    assert scenario.engine.scheduling_policy == "priority"
    simulation = Simulation(scenario, "none")
    assert {e.scheduling_policy for e in simulation.engines} == {"priority"}
    result = simulation.run()
    assert sum(a.outcome == "completed" for a in result.attempts) > 10
