"""`tokenpools authz`: the ext_authz service as a process — one HTTP server for Envoy's checks
(`/check/...`), GET /v1/models (routed here by Envoy), Prometheus (/metrics) and probes
(/healthz, /readyz); one gRPC server for Envoy's access-log service; the config followed (a
file, re-read on SIGHUP too; or the cluster's custom resources with a file beside them); the
tickets whose log line is overdue ended each second, the peers learnt every few; a graceful
stop on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc

from tokenpools.admission.access_log import LogFormat, RequestRecord, request_id, setup_logging
from tokenpools.authz.check import MODELS, PEER_HEADER, PREFIX, CheckRequest, Verdict
from tokenpools.authz.peers import Peers, resolver
from tokenpools.authz.service import SETTLE_TIMEOUT_S, Authorizer
from tokenpools.event_loop import new_loop
from tokenpools.host_config import open_config, run_until_stopped
from tokenpools.identity import Credentials
from tokenpools.openai_api.refusals import too_large
from tokenpools.probes import add_probes

log = logging.getLogger("tokenpools.authz")
TICK_INTERVAL_S = 0.25
EXPIRY_INTERVAL_S = 1.0
PEERS_INTERVAL_S = 5.0  # between two resolutions of the peers' name
DRAIN_S = 10.0  # not ready but answering, before a stop (two of Envoy's health checks)
LOG_GRACE_S = 15.0  # for the access-log lines of what still runs, before a stop ends it
# aiohttp's own ceiling on a check's body; the config's maxBodyBytes refuses below it (413)
MOST_BODY_BYTES = 256 << 20


@dataclass
class Running:
    """A started service: its ports (chosen by the system when asked for 0) and its parts."""

    authorizer: Authorizer
    http_port: int
    grpc_port: int
    _http: web.AppRunner
    _grpc: grpc.aio.Server
    _tending: list[asyncio.Task[None]]

    async def stop(self, grace_s: float = 5.0, drain_s: float = 0.0) -> None:
        """Report not ready and keep answering for `drain_s` (Envoy's health checks move the
        checks elsewhere meanwhile), stop taking checks, give the access-log streams `grace_s`
        to deliver the lines of what is still running, then end what still waits."""
        self.authorizer.draining = True
        await asyncio.sleep(drain_s)
        await self._http.cleanup()
        await self._grpc.stop(grace_s)
        for task in self._tending:
            task.cancel()
        await asyncio.gather(*self._tending, return_exceptions=True)
        await self.authorizer.stop()


def _answer(verdict: Verdict) -> web.Response:
    return web.Response(status=verdict.status, headers=verdict.headers, body=verdict.body)


def http_app(authorizer: Authorizer) -> web.Application:
    async def check(request: web.Request) -> web.Response:
        length = request.content_length
        limit = authorizer.door.max_body_bytes
        if length is not None and length > limit:  # refused before it is read
            record = RequestRecord(request_id(request.headers.get("x-request-id")), "", "")
            return _answer(authorizer.checker.refuse(record, too_large(limit)))
        body = await request.read()
        path = request.raw_path[len(PREFIX) :] or "/"
        peer = request.headers.get(PEER_HEADER)
        asked = CheckRequest(request.method, path, request.headers, body, peer)
        return _answer(await authorizer.checker.check(asked))

    async def models(request: web.Request) -> web.Response:
        shown = Credentials(request.headers, request.headers.get(PEER_HEADER))
        return _answer(await authorizer.checker.models(request.method, request.path, shown))

    app = web.Application(client_max_size=MOST_BODY_BYTES)
    app.router.add_route("*", PREFIX + "/{tail:.*}", check)
    app.router.add_get(MODELS, models)
    app.router.add_get(MODELS + "/{name:.+}", models)
    add_probes(app, authorizer)
    return app


async def _end_overdue(authorizer: Authorizer) -> None:
    while True:
        await asyncio.sleep(EXPIRY_INTERVAL_S)
        try:
            authorizer.tickets.end_overdue()
        except Exception:  # the next round tries again
            log.exception("ending overdue tickets failed")


async def _learn_peers(authorizer: Authorizer) -> None:
    assert authorizer.peers is not None
    while True:
        await authorizer.peers.refresh()
        await asyncio.sleep(PEERS_INTERVAL_S)


async def start(
    authorizer: Authorizer, host: str = "127.0.0.1", http_port: int = 9003, grpc_port: int = 9004
) -> Running:
    await authorizer.start(TICK_INTERVAL_S)
    server = grpc.aio.server()
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(authorizer.log_service, server)
    bound = server.add_insecure_port(f"{host}:{grpc_port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{grpc_port}")
    await server.start()
    # a check Envoy gave up on (its timeout, a client gone) is cancelled: nothing admitted
    # for it waits for a line that will carry no ticket
    runner = web.AppRunner(http_app(authorizer), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, http_port)
    await site.start()
    http_bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    tending = [asyncio.create_task(_end_overdue(authorizer))]
    if authorizer.peers is not None:
        tending.append(asyncio.create_task(_learn_peers(authorizer)))
    return Running(authorizer, http_bound, bound, runner, server, tending)


async def _serve(
    path: Path | None,
    namespace: str | None,
    host: str,
    ports: tuple[int, int],
    access_log: bool,
    settle_timeout_s: float,
    replicas: tuple[str, str] | None,
    ticket_header: bool,
) -> None:
    """Until SIGTERM or SIGINT: the service on the file at `path`, or (with `namespace`) on
    the cluster with that file beside it, each change adopted as it comes. `replicas`: this
    replica's access-log address and the name its peers resolve by (peers.py)."""
    config, source = open_config(path, namespace)
    peers = None
    if replicas is not None:
        own, name = replicas
        peers = Peers(own, resolver(name, int(own.rpartition(":")[2])))
    authorizer = Authorizer(
        config,
        access_log=access_log,
        settle_timeout_s=settle_timeout_s,
        peers=peers,
        ticket_header=ticket_header,
    )
    if source is not None:
        authorizer.ready_checks.append(source.stale)
    running = await start(authorizer, host, *ports)
    log.info("ext_authz on %s:%d (HTTP), access log on :%d (gRPC)", host, *ports)
    await run_until_stopped(authorizer, path, source, lambda: running.stop(LOG_GRACE_S, DRAIN_S))


def serve(
    path: Path | None,
    namespace: str | None,
    host: str = "127.0.0.1",
    http_port: int = 9003,
    grpc_port: int = 9004,
    log_format: LogFormat = "text",
    access_log: bool = True,
    settle_timeout_s: float = SETTLE_TIMEOUT_S,
    replicas: tuple[str, str] | None = None,
    ticket_header: bool = False,
) -> None:
    setup_logging(log_format)
    ports = (http_port, grpc_port)
    served = _serve(
        path, namespace, host, ports, access_log, settle_timeout_s, replicas, ticket_header
    )
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(served)
