"""The inference endpoints (chat, completions, responses, embeddings): authenticate, validate,
admit through the decision core, hand the admitted request to its `Exchange`, and report each
request once (access log, metrics), whatever its ending."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from tokenpools.admission import Stopped
from tokenpools.admission.access_log import RequestRecord, request_id
from tokenpools.gateway.exchange import TRACE_HEADERS, Exchange
from tokenpools.gateway.responses import answer, error
from tokenpools.gateway.resumable import Resumable
from tokenpools.gateway.runtime import GATEWAY, HEALTH_INTERVAL, Gateway
from tokenpools.gateway.tracing import Tracing
from tokenpools.identity import Credentials
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
    shown = Credentials(request.headers, request.remote)
    caller = await gw.door.identify(record, shown, request.content_length)
    if isinstance(caller, Stopped):
        return answer(caller.refusal)
    try:
        raw = await request.content.read(gw.door.max_body_bytes + 1)
    except (aiohttp.ClientPayloadError, web.RequestPayloadError, ConnectionResetError) as exc:
        reason = str(exc).replace("\n", " ").strip() or exc.__class__.__name__
        return answer(bad_request(f"the body could not be read: {reason}"))
    result = await gw.door.enter(record, caller, path, raw, task=asyncio.current_task())
    if isinstance(result, Stopped):
        return answer(result.refusal)
    admitted, pool_name = result.admitted, result.pool
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
        tap = result.tap(path)
        parts = (gw, admitted, backend, path, result.prompt_tokens, headers, trace, tap)
        deadline_s = gw.door.suspend_deadline_s(result)
        exchange = (
            Exchange(*parts)
            if deadline_s is None
            else Resumable(*parts, caller=caller, cleared=result, deadline_s=deadline_s)
        )
        try:
            return await exchange.run(request, result.body, forward)
        finally:
            admitted = exchange.admitted
            record.settled(exchange.usage, admitted.charge, admitted.evicted)
            if isinstance(exchange, Resumable) and exchange.suspensions:
                record.suspensions = exchange.suspensions
                record.suspended_s = exchange.suspended_s
                record.recomputed_prompt_tokens = exchange.recomputed
            record.first_token(exchange.first_token_at)
    finally:
        admitted.close()
