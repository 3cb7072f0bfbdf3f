"""`/dashboard`: a static page, shipped in the package (gateway/dashboard/, with uPlot vendored
from npm), that draws `/admin/history`. The page holds the admin key for its tab only and
sends it as a bearer token; the files themselves are public and carry no data."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from aiohttp import web

from tokenpools.gateway.admin import backends_json, not_admin
from tokenpools.gateway.runtime import GATEWAY

FILES = files("tokenpools.gateway") / "dashboard"
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# every file the page uses, and nothing else: no path from the request reaches the disk
SERVED = {
    "index.html",
    "dashboard.js",
    "dashboard.css",
    "vendor/uPlot.iife.min.js",
    "vendor/uPlot.min.css",
}


async def page(request: web.Request) -> web.StreamResponse:
    name = request.match_info.get("file") or "index.html"
    if name not in SERVED:
        raise web.HTTPNotFound()
    kind = TYPES[name[name.rindex(".") :]]
    body = (FILES / name).read_bytes()
    # no caching of the page itself, so an upgraded gateway serves its own page
    return web.Response(body=body, content_type=kind, headers={"Cache-Control": "no-cache"})


async def admin_history(request: web.Request) -> web.Response:
    """The history this replica keeps (gateway/history.py), and what is true right now: its
    backends' health and whether the shared store answers."""
    gw = request.app[GATEWAY]
    if not gw.is_admin(request):
        return not_admin()
    body: dict[str, Any] = gw.history.as_json()
    body["now"] = gw.clock()
    body["update_period_s"] = gw.admission.policy.update_period_s
    body["store"] = {
        "backend": gw.config.state.backend,
        "up": await gw.admission.store_answers(),
    }
    body["backends"] = {name: backends_json(pool) for name, pool in gw.pools.items()}
    return web.json_response(body)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/history", admin_history)
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/{file:.+}", page)
