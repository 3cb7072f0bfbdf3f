"""The inference endpoints (chat, completions, responses, embeddings): authenticate, validate,
admit through the decision core, hand the admitted request to its `Exchange`, and report each
request once (access log, metrics), whatever its ending."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from tokenpools.admission import AdmissionRequest, Stopped
from tokenpools.admission.access_log import RequestRecord, request_id
from tokenpools.control.tenancy import Refused
from tokenpools.gateway.exchange import TRACE_HEADERS, Exchange
from tokenpools.gateway.responses import answer, error, refused, too_large
from tokenpools.gateway.runtime import GATEWAY, HEALTH_INTERVAL, Gateway
from tokenpools.gateway.tracing import Tracing
from tokenpools.openai_api import (
    BadRequest,
    parse_body,
)
from tokenpools.openai_api.refusals import bad_request, retry_after


async def inference(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    record = RequestRecord(
        request_id(request.headers.get("x-request-id")), request.method, request.path
    )
    tracing, span = gw.tracing, None
    if tracing is not None:
        span = tracing.start(record, request.headers)
        trace = tracing.headers(span)  # the backend's spans join ours
    else:
        trace = {k: request.headers[k] for k in TRACE_HEADERS if k in request.headers}
    try:
        response = await _answer(request, gw, record, trace)
    except asyncio.CancelledError:
        record.status = 499  # the client went away
        raise
    except Exception:
        record.status = 500  # answered by the openai_errors middleware
        raise
    else:
        record.status = response.status
        if not response.prepared:
            response.headers["x-request-id"] = record.request_id
        return response
    finally:
        record.duration_s = time.monotonic() - record.started
        gw.observe.request(record)
        if span is not None:
            Tracing.end(span, record)


async def _answer(
    request: web.Request, gw: Gateway, record: RequestRecord, trace: dict[str, str]
) -> web.StreamResponse:
    path = request.path
    settings = gw.config.gateway
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        return too_large(settings.max_body_bytes)
    caller = await gw.caller_of(request)
    if isinstance(caller, Refused):
        gw.metrics.unauthorized.labels(caller.code).inc()
        return refused(caller)
    record.identified(caller)
    gw.metrics.identified(caller)
    try:
        raw = await request.content.read(settings.max_body_bytes + 1)
    except (aiohttp.ClientPayloadError, web.RequestPayloadError, ConnectionResetError) as exc:
        reason = str(exc).replace("\n", " ").strip() or exc.__class__.__name__
        return error(400, f"the body could not be read: {reason}", "invalid_request_error", None)
    if len(raw) > settings.max_body_bytes:
        return too_large(settings.max_body_bytes)
    try:
        body = parse_body(raw, path)
    except BadRequest as exc:
        return answer(bad_request(str(exc), exc.param))
    record.model, record.stream = body["model"], bool(body.get("stream"))
    result = await gw.admission.clear(AdmissionRequest(caller, path, body), gw.ask_engine)
    record.pool, record.counted_prompt_tokens = result.pool, result.prompt_tokens
    if isinstance(result, Stopped):
        if result.decision is not None and result.entitlement is not None:
            record.decided(result.decision, result.entitlement)
        return answer(result.refusal)
    decision = result.decision
    pool_name = result.pool
    record.decided(decision, decision.lease.entitlement)
    admitted = gw.admission.track(decision, asyncio.current_task())
    headers = {"x-request-id": record.request_id, **result.headers}
    try:
        backend = gw.pools[pool_name].choose()
        if backend is None:
            admitted.end(None)  # refunded: it never ran
            return error(
                503,
                f"no healthy backend for pool {pool_name!r}",
                "server_error",
                "no_backend",
                headers=retry_after(request.app[HEALTH_INTERVAL]) | headers,  # the next check
            )
        record.backend = backend.spec.url
        forward = None if result.rewritten else raw  # unchanged bodies go as they came
        exchange = Exchange(
            gw, admitted, backend, path, result.prompt_tokens, headers, trace, result.tap(path)
        )
        try:
            return await exchange.run(request, body, forward)
        finally:
            admitted = exchange.admitted
            record.settled(admitted.usage, admitted.charge, admitted.evicted)
            record.first_token(exchange.first_token_at)
    finally:
        admitted.close()
