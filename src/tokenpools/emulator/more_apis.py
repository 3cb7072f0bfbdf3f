"""The emulator's Responses API (/v1/responses, streamed as typed events) and embeddings
(/v1/embeddings: a prefill through the engine, and a vector derived from the text)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

from aiohttp import web

from tokenpools.emulator.server import DEFAULT_MAX_TOKENS, EMULATOR, read_body
from tokenpools.openai_api import RESPONSES, max_tokens
from tokenpools.prompt import estimate_prompt_tokens

EMBEDDING_SIZE = 8


async def embeddings(request: web.Request) -> web.StreamResponse:
    emu = request.app[EMULATOR]
    body = await read_body(request)
    if isinstance(body, web.Response):
        return body
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    prompt = estimate_prompt_tokens(body, 4.0)
    req = emu.submit(prompt, 1)  # the engine's prefill is what an embedding costs
    try:
        while await req.updates.get() >= 0:
            pass
    except asyncio.CancelledError:
        emu.abort(req)
        raise
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(json.dumps(item))}
        for i, item in enumerate(inputs)
    ]
    usage = {"prompt_tokens": prompt, "total_tokens": prompt}
    return web.json_response(
        {"object": "list", "data": data, "model": body["model"], "usage": usage}
    )


def _vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round(b / 255 - 0.5, 4) for b in digest[:EMBEDDING_SIZE]]


def _response(rid: str, model: str, status: str, text: str, usage: Any) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": [{"type": "message", "role": "assistant", "status": status, "content": content}]
        if text or status == "completed"
        else [],
        "usage": usage,
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}).encode() + b"\n\n"


async def responses(request: web.Request) -> web.StreamResponse:
    emu = request.app[EMULATOR]
    body = await read_body(request)
    if isinstance(body, web.Response):
        return body
    prompt = estimate_prompt_tokens(body, 4.0)
    req = emu.submit(prompt, max_tokens(body, RESPONSES) or DEFAULT_MAX_TOKENS)
    rid, model = f"resp-{req.req_id}", body["model"]
    generated = 0

    def usage() -> dict[str, int]:
        return {
            "input_tokens": prompt,
            "output_tokens": generated,
            "total_tokens": prompt + generated,
        }

    if not body.get("stream"):
        try:
            while (n := await req.updates.get()) >= 0:
                generated += n
        except asyncio.CancelledError:
            emu.abort(req)
            raise
        return web.json_response(_response(rid, model, "completed", "tok " * generated, usage()))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        created = _response(rid, model, "in_progress", "", None)
        await response.write(_event("response.created", {"response": created}))
        while (n := await req.updates.get()) >= 0:
            for _ in range(n):
                generated += 1
                delta = {"item_id": f"msg-{rid}", "output_index": 0, "content_index": 0}
                await response.write(
                    _event("response.output_text.delta", delta | {"delta": "tok "})
                )
        done = _response(rid, model, "completed", "tok " * generated, usage())
        await response.write(_event("response.completed", {"response": done}))
    except (asyncio.CancelledError, ConnectionResetError):
        emu.abort(req)
        raise
    return response
