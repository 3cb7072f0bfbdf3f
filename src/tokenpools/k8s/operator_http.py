"""The operator's HTTP side: probes and Prometheus metrics on :8080, and the validating
admission webhook over HTTPS on :9443 when a certificate is mounted
(`TOKENPOOLS_WEBHOOK_CERT_DIR` holding tls.crt and tls.key, as cert-manager writes them)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenpools.k8s.api import Kube
from tokenpools.k8s.operator_loop import OperatorLoop
from tokenpools.k8s.webhook import Lookup, review
from tokenpools.k8s.webhook_cache import CachedLookup

MAX_REVIEW_BYTES = 3 << 20  # an AdmissionReview carries the object and its old version


def probe_app(loop: OperatorLoop) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        if loop.alive():
            return web.Response(text="ok")
        return web.Response(status=503, text="the heartbeat schedule has stopped")

    async def readyz(_: web.Request) -> web.Response:
        if loop.last_heartbeat is None:
            return web.Response(status=503, text="no leader election yet")
        return web.Response(text="leader" if loop.leading else "standby")

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(loop.rec.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


def webhook_app(lookup: Lookup) -> web.Application:
    async def validate(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "expected an AdmissionReview"}, status=400)
        answer = await asyncio.to_thread(review, body, lookup)  # lookups are blocking calls
        return web.json_response(answer)

    app = web.Application(client_max_size=MAX_REVIEW_BYTES)
    app.router.add_post("/validate", validate)
    return app


def tls_context(cert_dir: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_dir / "tls.crt", cert_dir / "tls.key")
    return ctx


async def serve_http(loop: OperatorLoop, kube: Kube, env: Mapping[str, str]) -> None:
    runners: list[Any] = []
    probes = web.AppRunner(probe_app(loop))
    await probes.setup()
    await web.TCPSite(probes, "0.0.0.0", int(env.get("TOKENPOOLS_PROBE_PORT", "8080"))).start()
    runners.append(probes)
    cert_dir = env.get("TOKENPOOLS_WEBHOOK_CERT_DIR")
    if cert_dir and (Path(cert_dir) / "tls.crt").exists():
        lookup = CachedLookup(kube).start()  # watches, so an admission lists nothing
        runners.append(lookup)
        hook = web.AppRunner(webhook_app(lookup))
        await hook.setup()
        port = int(env.get("TOKENPOOLS_WEBHOOK_PORT", "9443"))
        await web.TCPSite(hook, "0.0.0.0", port, ssl_context=tls_context(Path(cert_dir))).start()
        runners.append(hook)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            if isinstance(runner, CachedLookup):
                runner.stop()
            else:
                await runner.cleanup()
