"""The gateway's routes and lifecycle: the inference endpoints (gateway/inference.py), model
listing, health and readiness, metrics and the admin API; the background work (ticks, health
checks, capacity feedback) that runs while the app does.

Errors use the OpenAI body, unknown paths (404), wrong methods (405) and our own failures (500)
included. 401 unknown key or refused token (403: a tenant with nothing here), 400 bad body (JSON
nested over 64 levels too) or a request that can never fit, 404 unknown model, 413 body too
large, 429 shed (Retry-After, retry-after-ms), 403 expired entitlement, 502/503/504 backend
failures; every 503 says when to retry; every answer to an inference request carries
x-request-id and, once decided, x-ratelimit-*. The gateway never retries its own 429s.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web

from tokenpools.control.tenancy import Refused
from tokenpools.gateway import dashboard
from tokenpools.gateway.admin import admin_entitlements, admin_pools, admin_tenants
from tokenpools.gateway.inference import inference
from tokenpools.gateway.responses import answer, openai_errors, refused
from tokenpools.gateway.runtime import GATEWAY, HEALTH_INTERVAL, READY_CHECKS, Gateway
from tokenpools.gateway.usage_api import admin_budgets, admin_usage
from tokenpools.identity import Credentials
from tokenpools.openai_api import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, model_card
from tokenpools.openai_api.refusals import unknown_model

__all__ = ["GATEWAY", "Gateway", "make_app"]
log = logging.getLogger("tokenpools.gateway")


async def _models_of(request: web.Request) -> list[str] | web.Response:
    """The model names the caller may use, or the 401/403 to answer."""
    gw = request.app[GATEWAY]
    caller = await gw.door.caller(Credentials(request.headers, request.remote))
    if isinstance(caller, Refused):
        return refused(caller)
    return gw.admission.directory.models(caller)


async def list_models(request: web.Request) -> web.Response:
    models = await _models_of(request)
    if isinstance(models, web.Response):
        return models
    return web.json_response({"object": "list", "data": [model_card(m) for m in models]})


async def get_model(request: web.Request) -> web.Response:
    models = await _models_of(request)
    if isinstance(models, web.Response):
        return models
    name = request.match_info["model"]
    if name not in models:
        return answer(unknown_model(name))
    return web.json_response(model_card(name))


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def readyz(request: web.Request) -> web.Response:
    """Ready when every pool with backends has a healthy one and the shared store answers."""
    gw = request.app[GATEWAY]
    problems = [
        f"no healthy backend for pool {name}"
        for name, pool in gw.pools.items()
        if pool.backends and pool.choose() is None
    ]
    if not await gw.admission.store_answers():
        problems.append("the shared state store does not answer")
    for check in request.app.get(READY_CHECKS, []):
        problems += check()
    if problems:
        return web.Response(status=503, text="; ".join(problems))
    return web.Response(text="ready")


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = await gw.admission.background(gw.metrics.render)  # reads the store: off the loop
    return web.Response(body=body, content_type="text/plain")


def make_app(
    gateway: Gateway, tick_interval_s: float = 0.25, health_interval_s: float = 5.0
) -> web.Application:
    app = web.Application(
        client_max_size=gateway.config.gateway.max_body_bytes + 1, middlewares=[openai_errors]
    )
    app[HEALTH_INTERVAL] = health_interval_s
    app[GATEWAY] = gateway
    for path in (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS):
        app.router.add_post(path, inference)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/pools", admin_pools)
    app.router.add_get("/admin/entitlements", admin_entitlements)
    app.router.add_get("/admin/tenants", admin_tenants)
    app.router.add_get("/admin/usage", admin_usage)
    app.router.add_get("/admin/budgets", admin_budgets)
    dashboard.add_routes(app)

    async def background(app: web.Application) -> AsyncIterator[None]:
        await gateway.start(tick_interval_s, health_interval_s)
        yield
        await gateway.stop()

    async def draining(app: web.Application) -> None:
        gateway.drain()  # before aiohttp waits for the requests in flight

    app.on_shutdown.append(draining)
    app.cleanup_ctx.append(background)
    return app
