"""The gateway's HTTP handlers: authenticate, validate, admit through the decision core,
proxy to a backend, settle on every ending.

Errors use the OpenAI body. 401 unknown key, 400 bad body or a request that can never fit,
404 unknown model, 413 body too large, 429 shed (Retry-After, retry-after-ms and
x-ratelimit-* headers), 403 expired entitlement, 502/503/504 backend failures. The gateway
never retries its own 429s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web

from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Reason, Reject
from tokenpools.control.feedback import next_fraction
from tokenpools.gateway.backends import BackendPool, BackendState
from tokenpools.gateway.metrics import GatewayMetrics
from tokenpools.model.config import Config, StateSettings
from tokenpools.model.keys import key_matches
from tokenpools.model.request import RequestCost, Usage
from tokenpools.openai_api import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    error_body,
    estimate_prompt_tokens,
    max_tokens,
    parse_body,
    vllm_gauges,
)
from tokenpools.state.base import Store, StoreUnavailable
from tokenpools.state.memory import MemoryStore

log = logging.getLogger("tokenpools.gateway")

NOT_RETRYABLE = {
    Reason.EXCEEDS_ENTITLEMENT: 400,
    Reason.EXCEEDS_POOL: 400,
    Reason.ENTITLEMENT_EXPIRED: 403,
    Reason.UNKNOWN_ENTITLEMENT: 401,
}


@dataclass
class InFlight:
    """A request between admission and settlement; eviction cancels its task."""

    task: asyncio.Task[Any] | None
    evicted: bool = False


def open_store(settings: StateSettings) -> Store:
    if settings.backend == "memory":
        return MemoryStore()
    from tokenpools.state.redis_store import RedisStore  # redis-py only where it is used

    return RedisStore(
        settings.url,
        timeout_s=settings.timeout_s,
        retry_interval_s=settings.retry_interval_s,
        prefix=settings.key_prefix,
    )


def replica_name() -> str:
    """Unique per process start: lease ids begin with it, and a restarted replica must not
    reuse the ids its previous life left in a shared store."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class Gateway:
    config: Config
    clock: Callable[[], float] = time.time
    replica: str = field(default_factory=replica_name)
    core: DecisionCore = field(init=False)
    pools: dict[str, BackendPool] = field(init=False)
    inflight: dict[str, InFlight] = field(default_factory=dict)
    metrics: GatewayMetrics = field(init=False)
    session: aiohttp.ClientSession | None = None
    capacity_fraction: dict[str, float] = field(default_factory=dict)  # from capacity feedback

    def __post_init__(self) -> None:
        self.store = open_store(self.config.state)
        self.core = DecisionCore(
            self.config, store=self.store, now=self.clock(), replica=self.replica
        )
        self._next_renewal = 0.0
        self.pools = {name: BackendPool(p.backends) for name, p in self.config.pools.items()}
        self.metrics = GatewayMetrics(self)
        self.model_pool = self._models(self.config)

    @staticmethod
    def _models(config: Config) -> dict[str, str]:
        return {m: p.name for p in config.pools.values() for m in p.models}

    def reload(self, config: Config) -> None:
        """Adopt a validated config; leases of removed entitlements end their requests. The
        state backend is chosen at start: a change of it waits for a restart."""
        if config.state != self.config.state:
            log.warning("the state section changed: it takes effect at the next restart")
            config = replace(config, state=self.config.state)
        for lease in self.core.apply_config(config, self.clock()):
            self.evict(lease.lease_id)
        old = self.pools
        self.pools = {}
        for name, pool in config.pools.items():
            keep = old.get(name)
            same = keep is not None and [b.spec for b in keep.backends] == list(pool.backends)
            self.pools[name] = keep if same and keep is not None else BackendPool(pool.backends)
        self.config = config
        self.model_pool = self._models(config)

    def evict(self, lease_id: str) -> None:
        handle = self.inflight.get(lease_id)
        if handle is not None and handle.task is not None and not handle.evicted:
            handle.evicted = True
            handle.task.cancel()

    async def feedback(self, pool_name: str) -> None:
        """One round of capacity feedback for a pool: read its backends' vLLM gauges and move
        the pool's effective capacity by the control law."""
        pool = self.config.pools[pool_name]
        fb = pool.capacity_feedback
        if fb is None or self.session is None:
            return
        waiting = kv = 0.0
        for backend in self.pools[pool_name].backends:
            if not backend.healthy:
                continue
            try:
                async with self.session.get(
                    f"{backend.spec.url}/metrics", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    gauges = vllm_gauges(await r.read())
            except (aiohttp.ClientError, TimeoutError):
                continue
            waiting = max(waiting, gauges.get("vllm:num_requests_waiting", 0.0))
            kv = max(kv, gauges.get("vllm:kv_cache_usage_perc", 0.0))
        current = self.capacity_fraction.get(pool_name, 1.0)
        fraction = next_fraction(current, waiting, kv, fb)
        if fraction != current:
            self.capacity_fraction[pool_name] = fraction
            change = self.core.set_capacity(
                pool_name, self.clock(), per_replica=pool.per_replica.scale(fraction)
            )
            log.warning(
                "pool %s: capacity at %.0f%% (engine waiting %g, KV %.2f)",
                pool_name,
                100 * fraction,
                waiting,
                kv,
            )
            for lease in change.evict:
                self.evict(lease.lease_id)

    def tick(self) -> None:
        now = self.clock()
        result = self.core.tick(now)
        for lease in result.expired:
            self.evict(lease.lease_id)
        if now >= self._next_renewal:  # keep our leases alive; a lost one ends its request
            self._next_renewal = now + self.core.policy.lease_ttl_s / 4
            for lease_id in list(self.inflight):
                if not self.core.renew(lease_id, now):
                    self.evict(lease_id)

    def is_admin(self, request: web.Request) -> bool:
        key = _bearer(request)
        return key is not None and any(
            key_matches(key, h) for h in self.config.gateway.admin_key_hashes
        )


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def _error(
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


def _rejection(gw: Gateway, entitlement: str, decision: Reject) -> web.Response:
    status = NOT_RETRYABLE.get(decision.reason)
    message = f"{decision.message} ({decision.reason.value})"
    if decision.reason == Reason.STORE_UNAVAILABLE:
        headers = _retry_after(decision.retry_after_s or 1.0)
        return _error(503, message, "server_error", decision.reason.value, headers=headers)
    if status is not None:
        kind = "invalid_request_error" if status == 400 else "permission_error"
        param = "max_tokens" if status == 400 else None
        return _error(status, message, kind, decision.reason.value, param)
    wait = decision.retry_after_s if decision.retry_after_s is not None else 60.0
    view = gw.core.entitlements[entitlement]
    limit_requests = view.plan.ent_concurrency
    headers = {
        **_retry_after(wait),
        "x-ratelimit-limit-requests": _num(limit_requests),
        "x-ratelimit-reset-requests": f"{wait:.3f}s",
        "x-ratelimit-limit-tokens": _num(view.own_bucket.depth),
        "x-ratelimit-reset-tokens": f"{wait:.3f}s",
    }
    with contextlib.suppress(StoreUnavailable):  # the remaining counts need the store
        counters = gw.core.store.entitlement_counters(entitlement, gw.clock())
        remaining = max(0.0, limit_requests - counters.concurrency)
        headers["x-ratelimit-remaining-requests"] = _num(remaining)
        headers["x-ratelimit-remaining-tokens"] = _num(max(0.0, counters.bucket))
    return _error(429, message, "rate_limit_exceeded", decision.reason.value, headers=headers)


def _retry_after(wait: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(round(wait * 1000))}


def _num(x: float) -> str:
    return "unlimited" if math.isinf(x) else str(int(x))


async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    path = request.path
    settings = gw.config.gateway
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        return _too_large(settings.max_body_bytes)
    key = _bearer(request)
    entitlement = gw.core.entitlement_for_key(key) if key else None
    if entitlement is None:
        gw.metrics.unauthorized.inc()
        return _error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
    try:
        raw = await request.content.read(settings.max_body_bytes + 1)
    except (aiohttp.ClientPayloadError, ConnectionResetError):
        return _error(400, "the body could not be read", "invalid_request_error", None)
    if len(raw) > settings.max_body_bytes:
        return _too_large(settings.max_body_bytes)
    try:
        body = parse_body(raw, path)
    except BadRequest as exc:
        return _error(400, str(exc), "invalid_request_error", None, exc.param)
    view = gw.core.entitlements[entitlement]
    pool_name = gw.model_pool.get(body["model"])
    if pool_name is None or pool_name != view.ent.pool:
        return _error(
            404,
            f"model {body['model']!r} does not exist or this key has no access to it",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    prompt_tokens = estimate_prompt_tokens(body, settings.chars_per_token)
    requested = max_tokens(body)
    decision = gw.core.admit(entitlement, RequestCost(prompt_tokens, requested), gw.clock())
    gw.metrics.decided(entitlement, decision)
    if isinstance(decision, Reject):
        return _rejection(gw, entitlement, decision)
    for victim in decision.evict:
        gw.evict(victim.lease_id)
    lease_id = decision.lease.lease_id
    handle = InFlight(asyncio.current_task())
    gw.inflight[lease_id] = handle
    backend = gw.pools[pool_name].choose()
    try:
        if backend is None:
            gw.core.release(lease_id, gw.clock())
            return _error(
                503, f"no healthy backend for pool {pool_name!r}", "server_error", "no_backend"
            )
        forward: bytes | None = raw  # unchanged bodies go upstream as they came
        if requested is None:  # the reservation assumed the default: make it true
            body["max_tokens"] = view.default_max_tokens
            forward = None
        return await _proxy(
            request, gw, backend, body, forward, path, lease_id, prompt_tokens, handle
        )
    finally:
        gw.inflight.pop(lease_id, None)


def _too_large(limit: int) -> web.Response:
    return _error(
        413, f"the body is larger than {limit} bytes", "invalid_request_error", "body_too_large"
    )


async def _proxy(
    request: web.Request,
    gw: Gateway,
    backend: BackendState,
    body: dict[str, Any],
    raw: bytes | None,
    path: str,
    lease_id: str,
    prompt_tokens: int,
    handle: InFlight,
) -> web.StreamResponse:
    assert gw.session is not None
    stream = bool(body.get("stream"))
    wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if stream and not wants_usage:  # always ask for usage, so a stream settles on real numbers
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        raw = None
    data = raw if raw is not None else json.dumps(body).encode()
    backend.inflight += 1
    streamed = 0
    response: web.StreamResponse | None = None
    settled = False

    def settle(usage: Usage | None, refund: bool = True) -> None:
        nonlocal settled
        if settled or handle.evicted:
            return
        settled = True
        now = gw.clock()
        if usage is not None:
            gw.core.settle(lease_id, usage, now)
        else:
            gw.core.release(lease_id, now, refund=refund)

    try:
        async with gw.session.post(
            backend.spec.url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=backend.spec.timeout_s),
        ) as upstream:
            if upstream.status != 200:
                text = await upstream.read()
                settle(None)
                status = upstream.status if upstream.status < 500 else 502
                return web.Response(status=status, body=text, content_type="application/json")
            if not stream:
                raw = await upstream.read()
                try:
                    payload = json.loads(raw)
                except ValueError:
                    payload = {}
                settle(
                    _usage(
                        payload.get("usage") if isinstance(payload, dict) else None, prompt_tokens
                    )
                )
                return web.Response(body=raw, content_type="application/json")
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await response.prepare(request)
            usage: Usage | None = None
            async for data in _sse(upstream.content):
                if data == b"[DONE]":
                    await response.write(b"data: [DONE]\n\n")
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:  # not ours to judge: pass it on
                    await response.write(b"data: " + data + b"\n\n")
                    continue
                if not isinstance(chunk, dict):
                    chunk = {}
                if chunk.get("usage") and not chunk.get("choices"):
                    usage = _usage(chunk["usage"], prompt_tokens)
                    if not wants_usage:
                        continue  # the client did not ask for it: strip what we added
                elif chunk.get("choices"):
                    streamed += 1
                await response.write(b"data: " + data + b"\n\n")
            settle(usage or Usage(prompt_tokens, streamed))
            return response
    except asyncio.CancelledError:
        if handle.evicted:  # preempted by a higher-priority request: tell the client why
            if response is not None:
                with contextlib.suppress(ConnectionResetError, RuntimeError):
                    await response.write(_preempted_event())
                return response
            return _error(503, "preempted by higher-priority work", "server_error", "preempted")
        settle(Usage(prompt_tokens, streamed) if streamed else None, refund=False)
        raise
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        backend.healthy = not isinstance(exc, aiohttp.ClientConnectorError)
        if response is None:
            settle(None)
            return _error(
                502, f"backend error: {exc.__class__.__name__}", "server_error", "backend_error"
            )
        settle(Usage(prompt_tokens, streamed))
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await response.write(_error_event("the backend failed mid-stream", "backend_error"))
        return response
    except TimeoutError:
        if response is None:
            settle(None, refund=False)
            return _error(504, "the backend timed out", "server_error", "backend_timeout")
        settle(Usage(prompt_tokens, streamed))
        with contextlib.suppress(ConnectionResetError, RuntimeError):
            await response.write(_error_event("the backend timed out", "backend_timeout"))
        return response
    except ConnectionResetError:  # the client went away while we wrote
        settle(Usage(prompt_tokens, streamed), refund=False)
        return response or web.Response(status=499)
    finally:
        backend.inflight -= 1
        if not settled and not handle.evicted:
            settle(None, refund=False)


async def _sse(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    async for line in content:
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip()


def _usage(usage: Any, prompt_tokens: int) -> Usage:
    if isinstance(usage, dict):
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int) and prompt >= 0 <= completion:
            return Usage(prompt, completion)
    return Usage(prompt_tokens, 0)


def _error_event(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, "server_error", code) + b"\n\n"


def _preempted_event() -> bytes:
    return _error_event(
        "this request was preempted by higher-priority work; retry later", "preempted"
    )


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    key = _bearer(request)
    entitlement = gw.core.entitlement_for_key(key) if key else None
    if entitlement is None:
        return _error(401, "invalid API key", "invalid_request_error", "invalid_api_key")
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
    return web.Response(body=gw.metrics.render(), content_type="text/plain")


Handler = Callable[[web.Request], Awaitable[web.Response]]


def admin_only(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.Response:
        if not request.app[GATEWAY].is_admin(request):
            return _error(401, "admin key required", "invalid_request_error", "invalid_api_key")
        try:
            return await handler(request)
        except StoreUnavailable as exc:
            return _error(
                503, f"state store unreachable: {exc}", "server_error", "store_unavailable"
            )

    return guarded


@admin_only
async def admin_pools(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
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
                {"url": b.spec.url, "healthy": b.healthy, "in_flight": b.inflight}
                for b in gw.pools[name].backends
            ],
        }
    return web.json_response(out)


@admin_only
async def admin_entitlements(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    now = gw.clock()
    out = {}
    for name, view in gw.core.entitlements.items():
        c = gw.core.store.entitlement_counters(name, now)
        scores = gw.core.store.scores(name)
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
    return web.json_response(out)


def make_app(
    gateway: Gateway, tick_interval_s: float = 0.25, health_interval_s: float = 5.0
) -> web.Application:
    app = web.Application(client_max_size=gateway.config.gateway.max_body_bytes + 1)
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

        async def ticking() -> None:
            while True:
                await asyncio.sleep(tick_interval_s)
                gateway.tick()

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
        await gateway.session.close()

    app.cleanup_ctx.append(background)
    return app
