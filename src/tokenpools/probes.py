"""The HTTP face every host beside a data plane has (`tokenpools extproc`, `tokenpools authz`):
Prometheus' /metrics, liveness at /healthz, readiness at /readyz with the reasons it is not."""

from __future__ import annotations

from aiohttp import web

from tokenpools.admission.host import AdmissionHost


def add_probes(app: web.Application, host: AdmissionHost) -> None:
    async def metrics(request: web.Request) -> web.Response:
        del request
        body = await host.admission.background(host.metrics.render)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def healthz(request: web.Request) -> web.Response:
        del request
        return web.Response(text="ok")

    async def readyz(request: web.Request) -> web.Response:
        del request
        why = await host.unready()
        if not why:
            return web.Response(text="ready")
        return web.Response(status=503, text="\n".join(why))

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
