"""The gateway's responses that are not a backend's, as aiohttp responses: OpenAI-shaped errors
(openai_api/refusals.py says what a refusal is)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from tokenpools.openai_api import error_body
from tokenpools.openai_api.refusals import Refusal, unauthorized
from tokenpools.openai_api.refusals import too_large as too_large_refusal

if TYPE_CHECKING:
    from tokenpools.control.tenancy import Refused

log = logging.getLogger("tokenpools.gateway")


def error(
    status: int,
    message: str,
    kind: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(message, kind, code, param),
        content_type="application/json",
        headers=headers,
    )


def answer(r: Refusal) -> web.Response:
    """A refusal (openai_api/refusals.py) as the gateway sends it."""
    return error(r.status, r.message, r.kind, r.code, r.param, r.headers)


def refused(why: Refused) -> web.Response:
    return answer(unauthorized(why))


def too_large(limit: int) -> web.Response:
    return answer(too_large_refusal(limit))


HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error the gateway answers has the OpenAI body: an unknown path, a wrong method,
    and an error of our own (500, logged) included."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        message = f"{request.method} {request.path}: {exc.reason}"
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        return error(exc.status, message, kind, HTTP_ERROR_CODES.get(exc.status), None, headers)
    except Exception:
        log.exception("error answering %s %s", request.method, request.path)
        return error(500, "internal error in the gateway", "server_error", "internal_error")
