"""One admitted request's exchange with a backend: the upstream request (the backend's model
name and API key, the request id, the trace context), the answer passed back with the backend's
headers (hop-by-hop ones excepted), and the lease settled exactly once on every ending: success,
backend error, timeout, client disconnect, eviction; streams included (usage is always asked of
the engine, so a stream settles on its own counts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from tokenpools.admission import Admitted
from tokenpools.gateway.backends import BackendState
from tokenpools.gateway.responses import error
from tokenpools.gateway.runtime import Gateway
from tokenpools.gateway.sse import events
from tokenpools.model.request import Usage
from tokenpools.openai_api import CHAT, COMPLETIONS, RESPONSES, error_body
from tokenpools.openai_api.refusals import retry_after
from tokenpools.openai_api.usage import (
    RESPONSE_END_TYPES,
    RESPONSE_ENDS,
    json_object,
    usage_from,
    usage_in,
)

# Not passed back: hop-by-hop headers (RFC 9110 §7.6.1) and what this server sets itself
# (the body is re-framed, and decompressed by the client session).
NOT_PASSED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
    }
)
TRACE_HEADERS = ("traceparent", "tracestate")
log = logging.getLogger("tokenpools.gateway")


class Exchange:
    """Owns what an admitted request holds between the backend and the client: its lease
    (settled once), its place in the backend's count, and the timings the logs report."""

    def __init__(
        self,
        gw: Gateway,
        admitted: Admitted,
        backend: BackendState,
        path: str,
        prompt_tokens: int,
        headers: dict[str, str],
        trace: dict[str, str],
    ) -> None:
        self.gw = gw
        self.admitted = admitted
        self.backend = backend
        self.path = path
        self.prompt_tokens = prompt_tokens
        self.headers = headers  # the gateway's own for the client: request id, rate limits
        self.trace = trace  # the trace context for the backend
        self.usage: Usage | None = None
        self.streamed = 0  # content events seen: the output estimate if the engine never says
        self.first_token_at: float | None = None

    def end(self, usage: Usage | None, refund: bool = True) -> None:
        """End the admitted request on `usage`, or release it (None: refund, or charge all of
        it); only its first end counts."""
        if self.admitted.end(usage, refund):
            self.usage = usage

    def _so_far(self) -> Usage:
        return Usage(self.prompt_tokens, self.streamed)

    async def run(
        self, request: web.Request, body: dict[str, Any], raw: bytes | None
    ) -> web.StreamResponse:
        gw, backend = self.gw, self.backend
        assert gw.session is not None
        stream = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if stream and not wants_usage and self.path in (CHAT, COMPLETIONS):
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            raw = None  # always ask for usage, so a stream settles on real numbers
        if backend.spec.model is not None and body["model"] != backend.spec.model:
            body["model"] = backend.spec.model
            raw = None
        upstream_headers = {"Content-Type": "application/json", **backend.auth, **self.trace}
        upstream_headers["x-request-id"] = self.headers["x-request-id"]
        backend.open_requests += 1
        response: web.StreamResponse | None = None
        try:
            async with gw.session.post(
                backend.spec.url + self.path,
                data=raw if raw is not None else json.dumps(body).encode(),
                headers=upstream_headers,
                timeout=aiohttp.ClientTimeout(total=backend.spec.timeout_s),
            ) as upstream:
                headers = self._passed(upstream.headers)
                if upstream.status in (401, 403):  # not the client's key: ours, upstream
                    self.end(None)
                    log.warning("backend %s refused the gateway's key", backend.spec.url)
                    return error(
                        502,
                        f"the backend refused the gateway's credentials (HTTP {upstream.status})",
                        "server_error",
                        "backend_auth",
                        headers=self.headers,
                    )
                if upstream.status != 200:  # its own words, e.g. a validation error
                    text = await upstream.read()
                    self.end(None)
                    status = upstream.status if upstream.status < 500 else 502
                    return web.Response(status=status, body=text, headers=headers)
                if not stream:
                    text = await upstream.read()
                    self.first_token_at = time.monotonic()
                    self.end(self._usage_of(text))
                    return web.Response(body=text, headers=headers)
                response = web.StreamResponse(headers=headers)
                response.headers["Cache-Control"] = "no-cache"
                await response.prepare(request)
                await self._relay(upstream.content, response, wants_usage)
                self.end(self.usage or self._so_far())
                return response
        except asyncio.CancelledError:
            if self.admitted.evicted:  # preempted by a higher-priority request: say why
                if response is not None:
                    await _write_quietly(response, _preempted_event())
                    return response
                return error(
                    503,
                    "preempted by higher-priority work",
                    "server_error",
                    "preempted",
                    headers=retry_after(1.0) | self.headers,
                )
            self.end(self._so_far() if self.streamed else None, refund=False)
            raise
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            backend.healthy = not isinstance(exc, aiohttp.ClientConnectorError)
            if response is None:
                self.end(None)
                return error(
                    502,
                    f"backend error: {exc.__class__.__name__}",
                    "server_error",
                    "backend_error",
                    headers=self.headers,
                )
            self.end(self._so_far())
            await _write_quietly(
                response, _error_event("the backend failed mid-stream", "backend_error")
            )
            return response
        except TimeoutError:
            if response is None:
                self.end(None, refund=False)
                return error(
                    504,
                    "the backend timed out",
                    "server_error",
                    "backend_timeout",
                    headers=self.headers,
                )
            self.end(self._so_far())
            await _write_quietly(response, _error_event("the backend timed out", "backend_timeout"))
            return response
        except ConnectionResetError:  # the client went away while we wrote
            self.end(self._so_far(), refund=False)
            return response or web.Response(status=499)
        finally:
            backend.open_requests -= 1
            self.admitted.close()  # whatever ended it: charged in full unless it ended

    def _passed(self, upstream: Any) -> CIMultiDict[str]:
        """The backend's response headers the client gets, with the gateway's own on top."""
        out: CIMultiDict[str] = CIMultiDict(
            (k, v) for k, v in upstream.items() if k.lower() not in NOT_PASSED
        )
        for name, value in self.headers.items():
            out[name] = value
        return out

    def _usage_of(self, text: bytes) -> Usage:
        """The engine's counts in a whole response, found without parsing it (an embeddings
        answer can be megabytes of floats); the estimate if it has none."""
        found = usage_in(text)
        return found if found is not None else Usage(self.prompt_tokens, 0)

    async def _relay(
        self, content: aiohttp.StreamReader, response: web.StreamResponse, wants_usage: bool
    ) -> None:
        """Pass the server-sent events on as they came, reading usage as they pass; the usage
        chunk the gateway asked for on the client's behalf is kept from it."""
        async for event, data in events(content):
            if data == b"[DONE]":
                await response.write(event)
                return
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if self._read(data) or wants_usage or self.path not in (CHAT, COMPLETIONS):
                await response.write(event)

    def _read(self, data: bytes) -> bool:
        """Count what an event carries; False for the usage-only chunk of a chat stream."""
        if self.path == RESPONSES:  # typed events; the last one carries the response's usage
            if b'"response.output_text.delta"' in data:
                self.streamed += 1
            elif any(end in data for end in RESPONSE_ENDS):
                event = json_object(data)
                if event.get("type") in RESPONSE_END_TYPES:
                    self.usage = usage_from((event.get("response") or {}).get("usage"))
            return True
        chunk = json_object(data)
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = usage_from(chunk["usage"])
            return False
        if chunk.get("choices"):
            self.streamed += 1
        return True


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionResetError, RuntimeError):
        await response.write(data)


def _error_event(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, "server_error", code) + b"\n\n"


def _preempted_event() -> bytes:
    return _error_event(
        "this request was preempted by higher-priority work; retry later", "preempted"
    )
