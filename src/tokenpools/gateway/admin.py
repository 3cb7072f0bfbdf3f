"""The admin API (`/admin/pools`, `/admin/entitlements`, `/admin/tenants`): admin keys only;
the store's counters, scores and the core's views as JSON, read off the event loop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tokenpools.control.store import StoreUnavailable
from tokenpools.gateway.backends import BackendPool
from tokenpools.gateway.responses import error
from tokenpools.gateway.runtime import GATEWAY, Gateway
from tokenpools.model.resources import Resources
from tokenpools.openai_api.refusals import retry_after

Handler = Callable[[web.Request], Awaitable[web.Response]]


def not_admin() -> web.Response:
    return error(401, "admin key required", "invalid_request_error", "invalid_api_key")


def admin_only(report: Callable[[Gateway], dict[str, Any]]) -> Handler:
    """A handler that answers admins with `report`, computed where store reads may wait."""

    async def guarded(request: web.Request) -> web.Response:
        gw = request.app[GATEWAY]
        if not gw.is_admin(request):
            return not_admin()
        try:
            return web.json_response(await gw.admission.background(report, gw))
        except StoreUnavailable as exc:
            return error(
                503,
                f"state store unreachable: {exc}",
                "server_error",
                "store_unavailable",
                headers=retry_after(gw.config.state.retry_interval_s),
            )

    return guarded


def backends_json(pool: BackendPool) -> list[dict[str, Any]]:
    return [
        {"url": b.spec.url, "healthy": b.healthy, "in_flight": b.open_requests}
        for b in pool.backends
    ]


def _resources(r: Resources | None) -> dict[str, float] | None:
    return None if r is None else r.as_dict()


@admin_only
def admin_pools(gw: Gateway) -> dict[str, Any]:
    out = {}
    for name, p in gw.admission.snapshot(gw.clock()).pools.items():
        out[name] = {
            "replicas": p.replicas,
            "capacity": _resources(p.capacity),
            "in_flight": p.in_flight,
            "reserved": {"concurrency": p.reserved_concurrency, "kv_tokens": p.reserved_kv},
            "holdback": {"concurrency": p.holdback_concurrency, "kv_tokens": p.holdback_kv},
            "claimed": {"concurrency": p.claimed_concurrency, "kv_tokens": p.claimed_kv},
            "bucket_tokens": p.bucket_tokens,
            "slo_reference_ms": p.slo_reference_ms,
            "desired_replicas": p.desired_replicas,
            "capacity_fraction": gw.capacity_fraction.get(name, 1.0),
            "backends": backends_json(gw.pools[name]),
        }
    return out


@admin_only
def admin_entitlements(gw: Gateway) -> dict[str, Any]:
    out = {}
    for name, e in gw.admission.snapshot(gw.clock()).entitlements.items():
        out[name] = {
            "tenant": e.tenant,
            "pool": e.pool,
            "class": e.service_class,
            "state": e.state,
            "baseline": _resources(e.baseline),
            "in_flight": e.in_flight,
            "reserved": {"concurrency": e.reserved_concurrency, "kv_tokens": e.reserved_kv},
            "used": _resources(e.used),
            "bucket_tokens": e.bucket_tokens,
            "debt": e.debt,
            "burst": e.burst,
            "priority": e.priority,
        }
    return out


@admin_only
def admin_tenants(gw: Gateway) -> dict[str, Any]:
    """Each tenant: its entitlements by pool in layer order (with their state and what they
    hold now), the models it may use, and its keys by label (never a hash)."""
    directory = gw.admission.directory
    ents = gw.admission.snapshot(gw.clock()).entitlements
    out: dict[str, Any] = {}
    for tenant in sorted(directory.tenants):
        layers = directory.layers(tenant)
        keys = gw.config.tenants[tenant].keys if tenant in gw.config.tenants else ()
        out[tenant] = {
            "in_flight": sum(ents[n].in_flight for names in layers.values() for n in names),
            "pools": {
                pool: [
                    {
                        "entitlement": n,
                        "class": ents[n].service_class,
                        "state": ents[n].state,
                        "in_flight": ents[n].in_flight,
                    }
                    for n in names
                ]
                for pool, names in layers.items()
            },
            "keys": [
                {
                    "label": k.label,
                    "expires_at": k.expires_at,
                    "models": None if k.models is None else sorted(k.models),
                }
                for k in keys
            ],
        }
    return out
