"""The gateway's responses that are not a backend's: OpenAI-shaped errors, 429s with
Retry-After, the x-ratelimit-* headers of every decision, and the bearer key of a request."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from tokenpools.control.decisions import Quota, Reason, Reject
from tokenpools.openai_api import error_body

log = logging.getLogger("tokenpools.gateway")
NOT_RETRYABLE = {
    Reason.EXCEEDS_ENTITLEMENT: 400,
    Reason.EXCEEDS_POOL: 400,
    Reason.ENTITLEMENT_EXPIRED: 403,
    Reason.UNKNOWN_ENTITLEMENT: 401,
}


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


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


@dataclass(frozen=True)
class Refusal:
    """How a refusal is answered over HTTP, whichever server answers it (this gateway, or a
    LiteLLM proxy through tokenpools.integrations.litellm)."""

    status: int
    message: str
    kind: str
    code: str
    param: str | None
    headers: dict[str, str]


def refusal(decision: Reject) -> Refusal:
    status = NOT_RETRYABLE.get(decision.reason)
    message = f"{decision.message} ({decision.reason.value})"
    code = decision.reason.value
    if decision.reason == Reason.STORE_UNAVAILABLE:
        headers = retry_after(decision.retry_after_s or 1.0)
        return Refusal(503, message, "server_error", code, None, headers)
    if status is not None:
        kind = "invalid_request_error" if status == 400 else "permission_error"
        param = "max_tokens" if status == 400 else None
        return Refusal(status, message, kind, code, param, {})
    wait = decision.retry_after_s if decision.retry_after_s is not None else 60.0
    headers = retry_after(wait) | ratelimit_headers(decision.quota)
    return Refusal(429, message, "rate_limit_exceeded", code, None, headers)


def rejection(decision: Reject) -> web.Response:
    r = refusal(decision)
    return error(r.status, r.message, r.kind, r.code, r.param, r.headers)


def retry_after(wait: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(round(wait * 1000))}


def ratelimit_headers(q: Quota | None) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers, numeric; none when the decision read no counters (the
    shared store was unreachable)."""
    if q is None or not math.isfinite(q.limit_requests + q.limit_tokens):
        return {}
    return {
        "x-ratelimit-limit-requests": str(int(q.limit_requests)),
        "x-ratelimit-remaining-requests": str(int(q.remaining_requests)),
        "x-ratelimit-reset-requests": f"{q.reset_requests_s:.3f}s",
        "x-ratelimit-limit-tokens": str(int(q.limit_tokens)),
        "x-ratelimit-remaining-tokens": str(int(q.remaining_tokens)),
        "x-ratelimit-reset-tokens": f"{q.reset_tokens_s:.3f}s",
    }


def invalid_key() -> web.Response:
    return error(401, "invalid API key", "invalid_request_error", "invalid_api_key")


def too_large(limit: int) -> web.Response:
    return error(
        413, f"the body is larger than {limit} bytes", "invalid_request_error", "body_too_large"
    )


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
