"""`tokenpools backend capacity` against the emulator, whose engine model is the truth.

The emulator is the engine model (engine/model.py) stepped in real time. What it sustains at
N concurrent streams is derived here without HTTP, clocks or the command's code: the same
model stepped in virtual time by N clients in closed loop over a long run (100 requests each),
with the one thing the emulator's loop adds, that a client's next request joins the step after
the one it was sent in. The command measures over real HTTP, in short rounds, against the real
clock, where the emulator's sleeps overshoot a little (its steps take a few percent longer
than the profile says): the two agree within 15 % (-3 % here), and pick the same concurrency
at the SLO."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from aiohttp import web
from typer.testing import CliRunner

from tests.servers import ServerThread
from tokenpools.cli import app
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.engine.model import Engine
from tokenpools.engine.profile import EngineProfile
from tokenpools.model.config_schema import PoolSpec
from tokenpools.processes import free_port
from tokenpools.prompt import estimate_prompt_tokens, prompt_text
from tokenpools.real_engines.measure_capacity import default_levels, llamacpp_kv, vllm_kv

# 4 slots, 20 ms steps (at full speed): up to 4 streams a request's first token comes after a
# step or two; the 5th to 8th wait for a slot, a whole request (~17 steps): the SLO separates
# the two.
PROFILE = EngineProfile(
    name="capacity-test",
    description="4 slots, 20 ms steps",
    max_num_seqs=4,
    max_num_batched_tokens=2048,
    kv_blocks=1024,
    t0_s=0.02,
    prefill_s_per_token=0.00002,
    decode_s_per_seq=0.001,
)
# The emulator runs at a quarter of the profile's speed (80 ms steps), the SLO scaled alike:
# it shares this process with the command, whose clients a busy neighbour can hold up for
# tens of milliseconds, and the first level to miss the SLO ends the sweep.
SPEED = 0.25
PROMPT, OUTPUT, SLO_MS = 64, 8, 100.0 / SPEED
SWEEP = ["--prompt-tokens", str(PROMPT), "--output-tokens", str(OUTPUT), "--requests", "2"]


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    server = ServerThread(make_emulator(PROFILE, speed=SPEED))
    yield server.url
    server.stop()


def capacity(*args: str) -> Any:
    return CliRunner().invoke(app, ["backend", "capacity", *args])


def sustained(streams: int, prompt: int, requests: int = 100) -> tuple[float, float]:
    """(tokens/s, TTFT p99 in s) of `streams` closed-loop clients on the engine model, in
    virtual time, as the emulator steps it (emulator/server.py `run`): it starts its next step
    as soon as it has handed out the last one's tokens, so a client's next request joins the
    step after that one; only an idle engine waits, for the first request to arrive."""
    engine, now = Engine(PROFILE.faster(SPEED)), 0.0
    sent: dict[str, float] = {}
    ids = (f"r{n}" for n in itertools.count())
    arrived = [next(ids) for _ in range(streams)]  # sent at the end of the last step
    ttft: list[float] = []
    finished = 0
    while finished < streams * requests:
        woken = 0 if engine.has_work else 1  # the first arrival wakes an idle engine
        for rid in arrived[:woken]:
            engine.add(rid, prompt, OUTPUT)
        step = engine.step()
        for rid in arrived[woken:]:  # the others wait in its queue for the step after
            engine.add(rid, prompt, OUTPUT)
        sent.update((rid, now) for rid in arrived)
        now += step.duration_s
        ttft += [now - sent[rid] for rid in step.first_tokens]
        finished += len(step.finished)
        arrived = [next(ids) for _ in step.finished]
    ordered = sorted(ttft)
    return finished * (prompt + OUTPUT) / now, ordered[int(0.99 * (len(ordered) - 1))]


def test_measured_capacity_is_what_the_engine_sustains_at_the_slo(emulator: str) -> None:
    result = capacity("--url", emulator, "--slo-ttft-ms", str(SLO_MS), *SWEEP,
                      "--max-concurrency", "8", "--kv-tokens", "16384")  # fmt: skip
    assert result.exit_code == 0, result.output
    measured = yaml.safe_load(result.stdout)["perReplica"]
    # the prompt as the emulator counts it (characters / 4 and the chat framing)
    prompt = round(
        statistics.median(
            estimate_prompt_tokens({"messages": [{"content": prompt_text(PROMPT, str(i))}]}, 4.0)
            for i in range(50)
        )
    )
    truth = {n: sustained(n, prompt) for n in (1, 2, 4, 8)}
    level = max(n for n, (_, ttft) in truth.items() if ttft * 1000 <= SLO_MS)
    assert level == 4 and truth[8][1] * 1000 > SLO_MS  # the SLO separates 4 from 8
    assert measured["concurrency"] == level
    error = measured["tokensPerSecond"] / truth[level][0] - 1
    print(f"measured {measured['tokensPerSecond']}, truth {truth[level][0]:.0f}: {error:+.1%}")
    assert abs(error) < 0.15
    assert measured["kvTokens"] == 16384
    # a pool takes it as it is
    PoolSpec.model_validate({"name": "p", "model": "SmolLM2-135M", "perReplica": measured})
    comments = " ".join(line.lstrip("# ") for line in result.stdout.splitlines())
    said = [
        "method: N streams in closed loop for N in 1, 2, 4, 8",
        f"SLO: TTFT p99 <= {SLO_MS:.0f} ms",
        "4 streams, the highest level that met the SLO; 8 streams missed it",
        "uncertainty: tokensPerSecond",
        "KV: given (--kv-tokens)",
    ]
    assert all(phrase in comments for phrase in said), result.stdout


def test_one_stream_missing_the_slo_is_an_error(emulator: str) -> None:
    result = capacity("--url", emulator, "--slo-ttft-ms", "5", *SWEEP, "--rounds", "1",
                      "--kv-tokens", "16384")  # fmt: skip
    assert result.exit_code == 1 and not isinstance(result.exception, AssertionError)
    assert "1 stream(s) already miss the SLO" in result.stderr
    assert not result.stdout


def refusal(*args: str) -> str:
    """What the command says on stderr for a run it refuses, checked as a clean refusal: exit
    code 1, no traceback, nothing on stdout."""
    result = capacity(*args)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert not result.stdout and "Traceback" not in result.stderr
    return " ".join(result.stderr.split())


def test_unreachable_backend() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert f"cannot reach {url}/v1/models" in refusal("--url", url, "--slo-ttft-ms", "500")


@pytest.fixture
def stub() -> Iterator[str]:
    """A web site, not an engine; behind /locked/ it wants a key, as an engine started with
    one does."""

    async def page(request: web.Request) -> web.Response:
        if request.path.startswith("/locked/"):
            return web.json_response({"error": {"message": "no key"}}, status=401)
        return web.Response(text="<html>a web site</html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/{tail:.*}", page)
    server = ServerThread(app)
    yield server.url
    server.stop()


def test_a_server_that_is_not_openai_compatible(stub: str) -> None:
    said = refusal("--url", stub, "--slo-ttft-ms", "500")
    assert f"{stub} is not an OpenAI-compatible server: GET /v1/models answered 200" in said
    said = refusal("--url", f"{stub}/locked", "--slo-ttft-ms", "500")
    assert "wants an API key (GET /v1/models: 401): --api-key-env" in said


def test_unknown_model_and_unknown_kv(emulator: str) -> None:
    said = refusal("--url", emulator, "--slo-ttft-ms", "500", "--model", "nope")
    assert "does not serve model 'nope'; it serves ['capacity-test']" in said
    # the emulator reports no KV capacity: said before minutes of measuring, not after
    said = refusal("--url", emulator, "--slo-ttft-ms", "500")
    assert "reports no KV capacity" in said and "--kv-tokens or --kv-cache-gib" in said


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--url", "127.0.0.1:8000"], "--url needs http:// or https://"),
        (["--kv-tokens", "1", "--kv-cache-gib", "1"], "give --kv-tokens or --kv-cache-gib"),
        (["--levels", "1,two"], "--levels takes whole numbers"),
        (["--levels", "0,4"], "--levels must be at least 1"),
        (["--api-key-env", "TOKENPOOLS_NO_SUCH_VARIABLE"], "TOKENPOOLS_NO_SUCH_VARIABLE is not"),
    ],
)
def test_bad_options(args: list[str], said: str) -> None:
    base = ["--url", "http://127.0.0.1:9", "--slo-ttft-ms", "500"]
    assert said in refusal(*base, *args)


VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27231",\
prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen3-8b"} 0.0
"""


def test_kv_as_the_engines_report_it() -> None:
    vllm = vllm_kv(VLLM_METRICS)
    assert vllm is not None and vllm.tokens == 27231 * 16 and "vLLM /metrics" in vllm.source
    assert vllm_kv("vllm:num_requests_running 0\n") is None  # the emulator: not reported
    assert vllm_kv(VLLM_METRICS.replace('num_gpu_blocks="27231"', 'num_gpu_blocks="None"')) is None
    props = {"default_generation_settings": {"n_ctx": 1024}, "total_slots": 4}
    found = llamacpp_kv(props)
    assert found is not None and found[0].tokens == 4096 and found[1] == 4
    assert llamacpp_kv({"total_slots": 4}) is None


def test_levels_double_up_to_the_most_and_stop_at_the_engines_slots() -> None:
    assert default_levels(64, None) == [1, 2, 4, 8, 16, 32, 64]
    assert default_levels(12, None) == [1, 2, 4, 8, 12]
    assert default_levels(64, 6) == [1, 2, 4, 6]
    assert default_levels(64, 1) == [1]
