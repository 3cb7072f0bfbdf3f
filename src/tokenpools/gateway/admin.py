"""The admin API (`/admin/pools`, `/admin/entitlements`): admin keys only; the store's
counters, scores and the core's views as JSON, read off the event loop."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tokenpools.control.store import StoreUnavailable
from tokenpools.gateway.responses import error, retry_after
from tokenpools.gateway.runtime import GATEWAY, Gateway

Handler = Callable[[web.Request], Awaitable[web.Response]]


def admin_only(report: Callable[[Gateway], dict[str, Any]]) -> Handler:
    """A handler that answers admins with `report`, computed where store reads may wait."""

    async def guarded(request: web.Request) -> web.Response:
        gw = request.app[GATEWAY]
        if not gw.is_admin(request):
            return error(401, "admin key required", "invalid_request_error", "invalid_api_key")
        try:
            return web.json_response(await gw.ledger.background(report, gw))
        except StoreUnavailable as exc:
            return error(
                503,
                f"state store unreachable: {exc}",
                "server_error",
                "store_unavailable",
                headers=retry_after(gw.config.state.retry_interval_s),
            )

    return guarded


@admin_only
def admin_pools(gw: Gateway) -> dict[str, Any]:
    now = gw.clock()
    out = {}
    for name, view in gw.core.pools.items():
        c = gw.core.store.pool_counters(name, now)
        cap = view.pool.capacity
        out[name] = {
            "replicas": view.pool.replicas,
            "capacity": {
                "tokens_per_s": cap.throughput,
                "kv_tokens": cap.kv_tokens,
                "concurrency": cap.concurrency,
            },
            "in_flight": c.leases,
            "reserved": {"concurrency": c.concurrency, "kv_tokens": c.kv_tokens},
            "holdback": {"concurrency": c.holdback_concurrency, "kv_tokens": c.holdback_kv},
            "bucket_tokens": c.bucket,
            "slo_reference_ms": view.slo_reference_ms,
            "desired_replicas": gw.core.desired_replicas(name),
            "capacity_fraction": gw.capacity_fraction.get(name, 1.0),
            "backends": [
                {"url": b.spec.url, "healthy": b.healthy, "in_flight": b.open_requests}
                for b in gw.pools[name].backends
            ],
        }
    return out


@admin_only
def admin_entitlements(gw: Gateway) -> dict[str, Any]:
    now = gw.clock()
    out = {}
    for name, view in gw.core.entitlements.items():
        c = gw.core.store.entitlement_counters(name, now)
        scores = gw.core.store.scores(name, now)
        obs = gw.core.observations.get(name)
        base = view.ent.baseline
        out[name] = {
            "tenant": view.ent.tenant_id,
            "pool": view.ent.pool,
            "class": view.ent.service_class.value,
            "state": view.state.value,
            "baseline": {
                "tokens_per_s": base.throughput,
                "kv_tokens": base.kv_tokens,
                "concurrency": base.concurrency,
            },
            "in_flight": c.leases,
            "reserved": {"concurrency": c.concurrency, "kv_tokens": c.kv_tokens},
            "used": None
            if obs is None
            else {
                "tokens_per_s": obs.usage.throughput,
                "kv_tokens": obs.usage.kv_tokens,
                "concurrency": obs.usage.concurrency,
            },
            "bucket_tokens": None if math.isinf(c.bucket) else c.bucket,
            "debt": scores.debt,
            "burst": scores.burst,
            "priority": view.priority,
        }
    return out
