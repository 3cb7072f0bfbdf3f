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
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from tokenpools.admission import Admitted
from tokenpools.gateway.backends import BackendState
from tokenpools.gateway.responses import answer, error
from tokenpools.gateway.runtime import Gateway
from tokenpools.model.request import Usage
from tokenpools.openai_api import error_body
from tokenpools.openai_api.answer_tap import AnswerTap
from tokenpools.openai_api.refusals import preempted

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
        tap: AnswerTap,
    ) -> None:
        self.gw = gw
        self.admitted = admitted
        self.backend = backend
        self.path = path
        self.prompt_tokens = prompt_tokens
        self.headers = headers  # the gateway's own for the client: request id, rate limits
        self.trace = trace  # the trace context for the backend
        self.tap = tap  # the answer read as it passes (the front door made it)

    @property
    def first_token_at(self) -> float | None:
        return self.tap.first_token_at

    @property
    def usage(self) -> Usage | None:
        """What the request was settled on, as the access log reports it."""
        return self.admitted.usage

    def _so_far(self) -> Usage:
        """The engine's usage, or the estimate from what was streamed."""
        return self.tap.so_far(self.prompt_tokens)

    async def run(
        self, request: web.Request, body: dict[str, Any], raw: bytes | None
    ) -> web.StreamResponse:
        gw, backend = self.gw, self.backend
        assert gw.session is not None
        stream = self.tap.stream
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
                    self.admitted.end(None)
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
                    self.admitted.end(None)
                    status = upstream.status if upstream.status < 500 else 502
                    return web.Response(status=status, body=text, headers=headers)
                if not stream:
                    text = await upstream.read()
                    self.tap.feed(text, end=True)
                    self.admitted.end(self._so_far())
                    return web.Response(body=text, headers=headers)
                response = web.StreamResponse(headers=headers)
                response.headers["Cache-Control"] = "no-cache"
                await response.prepare(request)
                await self._relay(upstream.content, response)
                self.admitted.end(self._so_far())
                return response
        except asyncio.CancelledError:
            if self.admitted.evicted:  # preempted by a higher-priority request: say why
                if response is not None:
                    await _write_quietly(response, _preempted_event())
                    return response
                why = preempted()
                return answer(replace(why, headers=why.headers | self.headers))
            self.admitted.abandon(self.tap, self.prompt_tokens)
            raise
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            backend.healthy = not isinstance(exc, aiohttp.ClientConnectorError)
            if response is None:
                self.admitted.end(None)
                return error(
                    502,
                    f"backend error: {exc.__class__.__name__}",
                    "server_error",
                    "backend_error",
                    headers=self.headers,
                )
            self.admitted.end(self._so_far())
            await _write_quietly(
                response, _error_event("the backend failed mid-stream", "backend_error")
            )
            return response
        except TimeoutError:
            if response is None:
                self.admitted.end(None, refund=False)
                return error(
                    504,
                    "the backend timed out",
                    "server_error",
                    "backend_timeout",
                    headers=self.headers,
                )
            self.admitted.end(self._so_far())
            await _write_quietly(response, _error_event("the backend timed out", "backend_timeout"))
            return response
        except ConnectionResetError:  # the client went away while we wrote
            self.admitted.end(self._so_far(), refund=False)
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

    async def _relay(self, content: aiohttp.StreamReader, response: web.StreamResponse) -> None:
        """Pass the server-sent events on whole, as they came, read by the tap as they pass
        (the usage chunk the gateway asked for on the client's behalf is kept from it)."""
        async for chunk in content.iter_any():
            sent = self.tap.feed(chunk)
            if sent:
                await response.write(sent)
        rest = self.tap.feed(b"", end=True)
        if rest:
            await response.write(rest)


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionResetError, RuntimeError):
        await response.write(data)


def _error_event(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, "server_error", code) + b"\n\n"


def _preempted_event() -> bytes:
    why = preempted()
    return _error_event(why.message, "preempted")
