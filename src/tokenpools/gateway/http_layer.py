"""Requests the HTTP parser refuses — bad framing, a bare CR or LF, obs-fold, a NUL, a line
without a colon, a line or header over the limit, a bad method — answered in the contract
like every other error: OpenAI's error JSON with a request id, naming the kind of problem and
echoing nothing of what was sent. Each is counted (`REFUSED`, read by /metrics) and logged at
warning level without a traceback, at most once per `LOG_EVERY_S` (with how many since), so
an outsider cannot flood the log. A handler's own crash stays a 500 logged with its traceback:
that one is ours.

aiohttp answers these before any route or middleware runs, in its connection handler; the
gateway's runner (`GatewayRunner`) gives its connections a handler that answers them instead.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from tokenpools.openai_api import error_body

log = logging.getLogger("tokenpools.gateway")
LOG_EVERY_S = 10.0

# The kinds of refusal, most specific first: (exception class, status, code, message). aiohttp's
# C parser reports every other fault (a CR, LF, NUL or control byte in a header, obs-fold, a
# line without a colon, bad Content-Length or chunk framing, a bad version) as one kind.
_KINDS: tuple[tuple[type[Exception], int, str, str], ...] = (
    (http_exceptions.BadHttpMethod, 400, "bad_http_method", "the request method is not valid"),
    (
        http_exceptions.LineTooLong,
        431,
        "header_too_large",
        "a request line or header field is longer than the gateway accepts",
    ),
    (http_exceptions.InvalidURLError, 400, "bad_http_target", "the request target is not valid"),
)
_DEFAULT = (
    400,
    "bad_http_request",
    "the request is not valid HTTP/1.1 (its framing, or a header's name or value)",
)


class HttpLayerRefusals:
    """Requests refused by the HTTP layer in this process, by code; the log's rate limit."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.counts: Counter[str] = Counter()
        self._clock = clock
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    def refused(self, code: str, peer: str | None) -> None:
        self.counts[code] += 1
        now = self._clock()
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        since = f" (and {self._unlogged} more since the last)" if self._unlogged else ""
        log.warning("refused a request the HTTP parser could not read: %s from %s%s",
                    code, peer or "-", since)  # fmt: skip
        self._logged_at, self._unlogged = now, 0


REFUSED = HttpLayerRefusals()  # one per process: the HTTP parser is the process's


def answer(exc: BaseException | None, status: int) -> tuple[int, str, str]:
    """(status, code, message) for a refusal of the parser: fixed words, nothing sent."""
    for kind, kind_status, code, message in _KINDS:
        if isinstance(exc, kind):
            return kind_status, code, message
    return (status if 400 <= status < 500 else _DEFAULT[0]), *_DEFAULT[1:]


class _ContractHandler(RequestHandler):
    __slots__ = ()  # the layout of aiohttp's handler: an instance of it becomes one of these

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # a handler crashed: ours, logged with its traceback
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:  # as aiohttp: an answer has begun, close instead
            raise ConnectionError("response already sent: cannot answer the error")
        status, code, text = answer(exc, status)
        REFUSED.refused(code, request.remote)
        response = web.Response(
            status=status,
            body=error_body(text, "invalid_request_error", code),
            content_type="application/json",
            headers={"x-request-id": f"req_{secrets.token_hex(12)}"},
        )
        response.force_close()
        return response


class _ContractServer(web.Server):
    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = _ContractHandler  # same slots: only handle_error differs
        return handler


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections answer the HTTP parser's refusals in the contract."""

    async def setup(self) -> None:
        await super().setup()
        server = self.server
        assert server is not None
        server.__class__ = _ContractServer
