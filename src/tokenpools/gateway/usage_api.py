"""`/admin/usage` (the ledger, grouped; JSON or CSV) and `/admin/budgets` (each budget's
current window): admin keys only. The usage the store holds is flushed to SQL first, so an
answer includes every request settled before it; while the ledger's database cannot be
written or read, a 503 names why (the usage waits in the store)."""

from __future__ import annotations

from aiohttp import web

from tokenpools.control.store import StoreUnavailable
from tokenpools.gateway.admin import not_admin
from tokenpools.gateway.responses import error
from tokenpools.gateway.runtime import GATEWAY
from tokenpools.usage.database import LedgerUnavailable
from tokenpools.usage.query import BadQuery, parse_query
from tokenpools.usage.report import group, to_csv


async def admin_usage(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not gw.is_admin(request):
        return not_admin()
    budgets = gw.admission.budgets
    params = dict(request.query)
    fmt = params.get("format", "json")
    try:
        if fmt not in ("json", "csv"):
            raise BadQuery(f"format: {fmt!r}; json or csv")
        query = parse_query(params, budgets.zone, gw.clock())
    except BadQuery as exc:
        return error(400, str(exc), "invalid_request_error", "invalid_parameter")
    try:
        buckets = await gw.ledger.usage(query.start, query.end)
    except LedgerUnavailable as exc:
        return error(503, str(exc), "server_error", "ledger_unavailable")
    rows = group(buckets, query.by, query.per, budgets.zone)
    if fmt == "csv":
        return web.Response(text=to_csv(rows), content_type="text/csv")
    return web.json_response(
        {"from": query.start, "to": query.end, "by": list(query.by), "per": query.per, "rows": rows}
    )


async def admin_budgets(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if not gw.is_admin(request):
        return not_admin()
    try:
        status = await gw.admission.background(gw.admission.budget_status, gw.clock())
    except StoreUnavailable as exc:
        return error(503, f"state store unreachable: {exc}", "server_error", "store_unavailable")
    return web.json_response({"budgets": status})
