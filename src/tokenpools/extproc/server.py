"""`tokenpools extproc`: the processor as a process — the gRPC server Envoy calls, gRPC
health, a small HTTP server for Prometheus (/metrics) and probes (/healthz, /readyz), the
config file followed (and re-read on SIGHUP), and a graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2_grpc

from tokenpools.admission.access_log import LogFormat, setup_logging
from tokenpools.admission.config_file import ConfigFile, reload_from
from tokenpools.event_loop import new_loop
from tokenpools.extproc.processor import Processor
from tokenpools.extproc.service import ExternalProcessor, Health
from tokenpools.model.config import load_config

log = logging.getLogger("tokenpools.extproc")
TICK_INTERVAL_S = 0.25


@dataclass
class Running:
    """A started processor: its ports (chosen by the system when asked for 0) and its parts."""

    processor: Processor
    grpc_port: int
    http_port: int
    _grpc: grpc.aio.Server
    _http: web.AppRunner
    _health: Health

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking streams, give those in flight `grace_s`, then end what is left."""
        await self._health.stop()
        await self._grpc.stop(grace_s)
        await self._http.cleanup()
        await self.processor.stop()


def _http_app(processor: Processor) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        del request
        body = await processor.admission.background(processor.metrics.render)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def healthz(request: web.Request) -> web.Response:
        del request
        return web.Response(text="ok")

    async def readyz(request: web.Request) -> web.Response:
        del request
        if await processor.ready():
            return web.Response(text="ready")
        return web.Response(status=503, text="the shared state store does not answer")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def start(
    processor: Processor, host: str = "127.0.0.1", port: int = 9002, http_port: int = 9090
) -> Running:
    await processor.start(TICK_INTERVAL_S)
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(processor), server)
    checks = Health(processor)
    health_pb2_grpc.add_HealthServicer_to_server(checks.servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    await checks.start()
    runner = web.AppRunner(_http_app(processor), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, http_port)
    await site.start()
    http_bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return Running(processor, bound, http_bound, server, runner, checks)


async def _serve(
    path: Path,
    host: str,
    port: int,
    http_port: int,
    access_log: bool,
    duplex: tuple[bool, bool],
) -> None:
    processor = Processor(
        load_config(path),
        access_log=access_log,
        duplex_answers=duplex[1],
        duplex_requests=duplex[0],
    )
    running = await start(processor, host, port, http_port)
    log.info("ext_proc on %s:%d (gRPC), metrics on :%d", host, running.grpc_port, running.http_port)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload_from(processor, path)))
    following = asyncio.create_task(ConfigFile(path).follow(processor, 2.0))
    await stopping.wait()
    following.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await following
    await running.stop()


def serve(
    path: Path,
    host: str = "127.0.0.1",
    port: int = 9002,
    http_port: int = 9090,
    log_format: LogFormat = "text",
    access_log: bool = True,
    duplex_answers: bool = False,
    duplex_requests: bool = False,
) -> None:
    setup_logging(log_format)
    duplex = (duplex_requests, duplex_answers)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(_serve(path, host, port, http_port, access_log, duplex))
