"""The gateway's HTTP handlers: authenticate, validate, admit through the decision core,
proxy to a backend, settle on every ending.

Errors use the OpenAI body, unknown paths (404), wrong methods (405) and our own failures (500)
included. 401 unknown key, 400 bad body (JSON nested over 64 levels too) or a request that can
never fit, 404 unknown model, 413 body too large, 429 shed (Retry-After, retry-after-ms and
x-ratelimit-* headers), 403 expired entitlement, 502/503/504 backend failures; every 503 says
when to retry. The gateway
never retries its own 429s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from tokenpools.control.decisions import Reject
from tokenpools.gateway.admin import admin_entitlements, admin_pools
from tokenpools.gateway.proxy import proxy
from tokenpools.gateway.responses import (
    bearer,
    error,
    openai_errors,
    rejection,
    retry_after,
    too_large,
)
from tokenpools.gateway.runtime import GATEWAY, AdmittedRequest, Gateway
from tokenpools.model.request import RequestCost
from tokenpools.openai_api import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    estimate_prompt_tokens,
    max_tokens,
    parse_body,
    sequences,
)

__all__ = ["GATEWAY", "Gateway", "make_app"]
HEALTH_INTERVAL = web.AppKey("health_interval_s", float)
log = logging.getLogger("tokenpools.gateway")


async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    path = request.path
    settings = gw.config.gateway
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        return too_large(settings.max_body_bytes)
    key = bearer(request)
    entitlement = gw.core.entitlement_for_key(key) if key else None
    if entitlement is None:
        gw.metrics.unauthorized.inc()
        return error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
    try:
        raw = await request.content.read(settings.max_body_bytes + 1)
    except (aiohttp.ClientPayloadError, ConnectionResetError):
        return error(400, "the body could not be read", "invalid_request_error", None)
    if len(raw) > settings.max_body_bytes:
        return too_large(settings.max_body_bytes)
    try:
        body = parse_body(raw, path)
        count = sequences(body, settings.max_sequences)
    except BadRequest as exc:
        return error(400, str(exc), "invalid_request_error", None, exc.param)
    pool_name = gw.model_pool.get(body["model"])
    if pool_name is None or pool_name != gw.core.entitlements[entitlement].ent.pool:
        return error(
            404,
            f"model {body['model']!r} does not exist or this key has no access to it",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    prompt_tokens = estimate_prompt_tokens(body, settings.chars_per_token)
    requested = max_tokens(body)
    cost = RequestCost(prompt_tokens, requested, count)
    decision = await gw.ledger.admit(entitlement, cost, gw.clock())
    gw.metrics.decided(entitlement, decision)
    if isinstance(decision, Reject):
        return rejection(decision)
    for victim in decision.evict:
        gw.evict(victim.lease_id)
    lease = decision.lease
    handle = AdmittedRequest(asyncio.current_task(), lease)
    gw.admitted_requests[lease.lease_id] = handle
    backend = gw.pools[pool_name].choose()
    try:
        if backend is None:
            gw.ledger.end(lease, None, gw.clock())
            return error(
                503,
                f"no healthy backend for pool {pool_name!r}",
                "server_error",
                "no_backend",
                headers=retry_after(request.app[HEALTH_INTERVAL]),  # the next health check
            )
        forward: bytes | None = raw  # unchanged bodies go upstream as they came
        if requested is None:  # the reservation assumed the default: make it true
            body["max_tokens"] = decision.max_tokens
            forward = None
        return await proxy(request, gw, backend, body, forward, path, prompt_tokens, handle)
    finally:
        gw.admitted_requests.pop(lease.lease_id, None)


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    key = bearer(request)
    entitlement = gw.core.entitlement_for_key(key) if key else None
    if entitlement is None:
        return error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
    pool = gw.config.pools[gw.core.entitlements[entitlement].ent.pool]
    data = [{"id": m, "object": "model", "owned_by": "tokenpools"} for m in pool.models]
    return web.json_response({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def readyz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    down = [name for name, pool in gw.pools.items() if pool.backends and pool.choose() is None]
    if down:
        return web.Response(status=503, text=f"no healthy backend for {', '.join(down)}")
    return web.Response(text="ready")


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = await gw.ledger.background(gw.metrics.render)  # reads the store: off the loop
    return web.Response(body=body, content_type="text/plain")


def make_app(
    gateway: Gateway, tick_interval_s: float = 0.25, health_interval_s: float = 5.0
) -> web.Application:
    app = web.Application(
        client_max_size=gateway.config.gateway.max_body_bytes + 1, middlewares=[openai_errors]
    )
    app[HEALTH_INTERVAL] = health_interval_s
    app[GATEWAY] = gateway
    app.router.add_post(CHAT, completions)
    app.router.add_post(COMPLETIONS, completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/pools", admin_pools)
    app.router.add_get("/admin/entitlements", admin_entitlements)

    async def background(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        gateway.session = aiohttp.ClientSession(connector=connector)
        await gateway.ledger.start()

        async def ticking() -> None:
            while True:
                await asyncio.sleep(tick_interval_s)
                try:
                    await gateway.tick()
                except Exception:  # a bad tick must not end ticking for good
                    log.exception("tick failed")

        async def health() -> None:
            while True:
                assert gateway.session is not None
                await asyncio.gather(*(p.check(gateway.session) for p in gateway.pools.values()))
                await asyncio.sleep(health_interval_s)

        async def feedback() -> None:
            while True:
                intervals = {
                    name: pool.capacity_feedback.interval_s
                    for name, pool in gateway.config.pools.items()
                    if pool.capacity_feedback is not None
                }
                await asyncio.sleep(min(intervals.values(), default=5.0))
                await asyncio.gather(*(gateway.feedback(name) for name in intervals))

        tasks = [
            asyncio.create_task(ticking()),
            asyncio.create_task(health()),
            asyncio.create_task(feedback()),
        ]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gateway.ledger.aclose()
        await gateway.session.close()

    app.cleanup_ctx.append(background)
    return app
