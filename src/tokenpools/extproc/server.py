"""`tokenpools extproc`: the processor as a process — the gRPC server Envoy calls, gRPC
health, a small HTTP server for Prometheus (/metrics) and probes (/healthz, /readyz), the
config followed (a file, re-read on SIGHUP too; or the cluster's custom resources with a file
beside them, as `tokenpools serve --kubernetes` does), and a graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2_grpc

from tokenpools.admission.access_log import LogFormat, setup_logging
from tokenpools.event_loop import new_loop
from tokenpools.extproc.processor import Processor
from tokenpools.extproc.service import ExternalProcessor, Health
from tokenpools.host_config import open_config, run_until_stopped
from tokenpools.probes import add_probes

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
    app = web.Application()
    add_probes(app, processor)
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
    path: Path | None,
    namespace: str | None,
    host: str,
    port: int,
    http_port: int,
    access_log: bool,
    duplex: tuple[bool, bool],
) -> None:
    """Until SIGTERM or SIGINT: the processor on the file at `path`, or (with `namespace`) on
    the cluster with that file beside it, each change adopted as it comes."""
    config, source = open_config(path, namespace)
    processor = Processor(
        config, access_log=access_log, duplex_requests=duplex[0], duplex_answers=duplex[1]
    )
    if source is not None:
        processor.ready_checks.append(source.stale)
    running = await start(processor, host, port, http_port)
    log.info("ext_proc on %s:%d (gRPC), metrics on :%d", host, running.grpc_port, running.http_port)
    await run_until_stopped(processor, path, source, running.stop)


def serve(
    path: Path | None,
    namespace: str | None,
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
        runner.run(_serve(path, namespace, host, port, http_port, access_log, duplex))
