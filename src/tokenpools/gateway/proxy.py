"""Proxying an admitted request to a backend and settling its lease on every ending:
success, backend error, timeout, client disconnect, eviction; streams included (usage is
always requested upstream, so a stream settles on the engine's own counts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from tokenpools.gateway.backends import BackendState
from tokenpools.gateway.responses import error, retry_after
from tokenpools.gateway.runtime import AdmittedRequest, Gateway
from tokenpools.model.request import Usage
from tokenpools.openai_api import error_body


async def proxy(
    request: web.Request,
    gw: Gateway,
    backend: BackendState,
    body: dict[str, Any],
    raw: bytes | None,
    path: str,
    prompt_tokens: int,
    handle: AdmittedRequest,
) -> web.StreamResponse:
    assert gw.session is not None
    stream = bool(body.get("stream"))
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if stream and not wants_usage:  # always ask for usage, so a stream settles on real numbers
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        raw = None
    data = raw if raw is not None else json.dumps(body).encode()
    backend.open_requests += 1
    streamed = 0
    response: web.StreamResponse | None = None
    settled = False

    def settle(usage: Usage | None, refund: bool = True) -> None:
        nonlocal settled
        if settled or handle.evicted:
            return
        settled = True
        gw.ledger.end(handle.lease, usage, gw.clock(), refund=refund)

    try:
        async with gw.session.post(
            backend.spec.url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=backend.spec.timeout_s),
        ) as upstream:
            if upstream.status != 200:
                text = await upstream.read()
                settle(None)
                status = upstream.status if upstream.status < 500 else 502
                return web.Response(status=status, body=text, content_type="application/json")
            if not stream:
                raw = await upstream.read()
                try:
                    payload = json.loads(raw)
                except ValueError:
                    payload = {}
                settle(
                    _usage(
                        payload.get("usage") if isinstance(payload, dict) else None, prompt_tokens
                    )
                )
                return web.Response(body=raw, content_type="application/json")
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            usage: Usage | None = None
            async for data in _sse(upstream.content):
                if data == b"[DONE]":
                    await response.write(b"data: [DONE]\n\n")
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:  # not ours to judge: pass it on
                    await response.write(b"data: " + data + b"\n\n")
                    continue
                if not isinstance(chunk, dict):
                    chunk = {}
                if chunk.get("usage") and not chunk.get("choices"):
                    usage = _usage(chunk["usage"], prompt_tokens)
                    if not wants_usage:
                        continue  # the client did not ask for it: strip what we added
                elif chunk.get("choices"):
                    streamed += 1
                await response.write(b"data: " + data + b"\n\n")
            settle(usage or Usage(prompt_tokens, streamed))
            return response
    except asyncio.CancelledError:
        if handle.evicted:  # preempted by a higher-priority request: tell the client why
            if response is not None:
                with contextlib.suppress(ConnectionResetError, RuntimeError):
                    await response.write(_preempted_event())
                return response
            return error(
                503,
                "preempted by higher-priority work",
                "server_error",
                "preempted",
                headers=retry_after(1.0),
            )
        settle(Usage(prompt_tokens, streamed) if streamed else None, refund=False)
        raise
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        backend.healthy = not isinstance(exc, aiohttp.ClientConnectorError)
        if response is None:
            settle(None)
            return error(
                502, f"backend error: {exc.__class__.__name__}", "server_error", "backend_error"
            )
        settle(Usage(prompt_tokens, streamed))
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await response.write(_error_event("the backend failed mid-stream", "backend_error"))
        return response
    except TimeoutError:
        if response is None:
            settle(None, refund=False)
            return error(504, "the backend timed out", "server_error", "backend_timeout")
        settle(Usage(prompt_tokens, streamed))
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await response.write(_error_event("the backend timed out", "backend_timeout"))
        return response
    except ConnectionResetError:  # the client went away while we wrote
        settle(Usage(prompt_tokens, streamed), refund=False)
        return response or web.Response(status=499)
    finally:
        backend.open_requests -= 1
        if not settled and not handle.evicted:
            settle(None, refund=False)


async def _sse(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    async for line in content:
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


def _usage(usage: Any, prompt_tokens: int) -> Usage:
    if isinstance(usage, dict):
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int) and prompt >= 0 <= completion:
            return Usage(prompt, completion)
    return Usage(prompt_tokens, 0)


def _error_event(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, "server_error", code) + b"\n\n"


def _preempted_event() -> bytes:
    return _error_event(
        "this request was preempted by higher-priority work; retry later", "preempted"
    )
