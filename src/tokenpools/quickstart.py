"""`tokenpools quickstart`: the shortest path to a working gateway. An emulated vLLM and the
gateway in front of it, on the example config (its first pool pointed at the emulator), in
this one process; one request sent through it as a client would, its answer printed with what
admitted it; then both keep serving for the user's own requests until Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.engine.profile import load_profile
from tokenpools.gateway.app import make_app as make_gateway
from tokenpools.gateway.http_layer import GatewayRunner
from tokenpools.gateway.runtime import Gateway
from tokenpools.model.config import parse_config
from tokenpools.shipped import EXAMPLE_CONFIG

PROFILE = "paper-dgx-spark-qwen3-8b"  # the emulator's default: Qwen3-8B on one GPU
KEY = "sk-guaranteed-a"  # the example config's guaranteed tenant (its keys: the file's header)
MODEL = "qwen3-8b"


@dataclass(frozen=True)
class FirstAnswer:
    status: int
    entitlement: str
    service_class: str
    text: str
    usage: dict[str, Any]


def config_data(backend: str) -> dict[str, Any]:
    """The example config with its first pool served by `backend`."""
    data: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    data["pools"][0]["backends"] = [{"url": backend}]
    return data


async def _site(runner: web.AppRunner, host: str, port: int) -> str:
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return f"http://{host}:{bound}"


async def ask(gateway: str, key: str = KEY, model: str = MODEL) -> FirstAnswer:
    """One chat completion through the gateway, as the openai client sends it."""
    body = {"model": model, "max_tokens": 32,
            "messages": [{"role": "user", "content": "Say hello to tokenpools."}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gateway}/v1/chat/completions", json=body, headers=headers) as answer,
    ):
        data = await answer.json()
        text = (
            data["choices"][0]["message"]["content"]
            if answer.status == 200
            else json.dumps(data.get("error", data))
        )
        return FirstAnswer(
            answer.status,
            answer.headers.get("x-tokenpools-entitlement", ""),
            answer.headers.get("x-tokenpools-service-class", ""),
            text,
            data.get("usage") or {},
        )


def _told(gateway: str, first: FirstAnswer) -> str:
    return "\n".join([
        f"tokenpools gateway on {gateway}, in front of an emulated vLLM serving {MODEL!r}",
        f"first request: HTTP {first.status}, admitted as {first.entitlement} "
        f"({first.service_class}); usage {first.usage}",
        f"  answer: {first.text[:120]}",
        "",
        "Try it (example keys: sk-guaranteed-a, sk-spot-b, sk-batch; the admin key sk-admin):",
        f"  curl -s {gateway}/v1/chat/completions -H 'Authorization: Bearer sk-spot-b' \\",
        f"    -H 'Content-Type: application/json' -d '{{\"model\": \"{MODEL}\", "
        "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'",
        f"  {gateway}/dashboard (admin key), {gateway}/metrics; "
        f"`tokenpools example-config` prints the config.",
    ])  # fmt: skip


async def run(host: str, port: int, backend_port: int, once: bool, say: Any = print) -> int:
    """Serve until cancelled (or, with `once`, until the first answer); 0 if it was a 200."""
    emulator = web.AppRunner(make_emulator(load_profile(PROFILE)), access_log=None)
    backend = await _site(emulator, host, backend_port)
    gateway_app = make_gateway(Gateway(parse_config(config_data(backend)), access_log=False))
    runner = GatewayRunner(gateway_app, handler_cancellation=True, access_log=None)
    try:
        gateway = await _site(runner, host, port)
        first = await ask(gateway)
        say(_told(gateway, first))
        if not once:
            say("serving; Ctrl-C stops")
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        return 0 if first.status == 200 else 1
    finally:
        await runner.cleanup()
        await emulator.cleanup()
