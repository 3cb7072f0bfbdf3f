"""`tokenpools serve`: the gateway process — config reloads, signals, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from tokenpools.admission.access_log import LogFormat, setup_logging
from tokenpools.admission.config_file import ConfigFile, reload_from
from tokenpools.event_loop import new_loop
from tokenpools.gateway.app import make_app
from tokenpools.gateway.http_layer import GatewayRunner
from tokenpools.gateway.runtime import READY_CHECKS, Gateway
from tokenpools.gateway.tracing import otlp_tracing
from tokenpools.model.config import load_config

log = logging.getLogger("tokenpools.gateway")


def build(path: Path, watch_interval_s: float = 2.0, **options: Any) -> web.Application:
    """The gateway of a config file; `options` are Gateway's (access_log, tracing)."""
    gateway = Gateway(load_config(path), **options)
    app = make_app(gateway)
    config_file = ConfigFile(path)

    async def follow(app: web.Application) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        reloads: set[asyncio.Task[bool]] = set()

        def on_sighup() -> None:
            task = loop.create_task(reload_from(gateway, path))
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, on_sighup)
        polling = asyncio.create_task(config_file.follow(gateway, watch_interval_s))
        yield
        polling.cancel()
        loop.remove_signal_handler(signal.SIGHUP)

    app.cleanup_ctx.append(follow)
    return app


def build_kubernetes(
    kube: Any, namespace: str, path: Path | None = None, **options: Any
) -> web.Application:
    """The gateway fed from the cluster: pools, entitlements, budgets and the platform
    namespace's backend-key Secrets watched, with the file at `path` (if any) beside them
    (k8s/following.py: the rule), each change adopted as a file reload is (an invalid set is
    logged and the running config kept); /readyz fails while a watch gets no answers."""
    from tokenpools.k8s.following import base_of, follow_cluster
    from tokenpools.k8s.source import ClusterSource

    source = ClusterSource(kube, namespace, base_of(path)).start()
    gateway = Gateway(source.config(), **options)
    app = make_app(gateway)
    app[READY_CHECKS] = [source.stale]

    async def follow(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(follow_cluster(source, gateway, path))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        source.stop()

    app.cleanup_ctx.append(follow)
    return app


def serve(
    path: Path | None,
    host: str,
    port: int,
    shutdown_timeout_s: float,
    namespace: str | None = None,
    log_format: LogFormat = "text",
    access_log: bool = True,
    otel: bool = False,
) -> None:
    setup_logging(log_format)
    tracing = otlp_tracing() if otel or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else None
    options: dict[str, Any] = {"access_log": access_log, "tracing": tracing}
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream request and settles the lease. SIGTERM/SIGINT stop accepting and give requests
    # in flight `shutdown_timeout_s` to finish.
    if namespace is None:
        assert path is not None
        application = build(path, **options)
    else:  # --kubernetes: the cluster is the config, a file beside it the rest
        from tokenpools.k8s.api import Kube, load_client

        application = build_kubernetes(Kube(load_client()), namespace, path, **options)
    _run(application, new_loop(), host, port, shutdown_timeout_s)


def _run(
    app: web.Application,
    loop: asyncio.AbstractEventLoop,
    host: str,
    port: int,
    shutdown_timeout_s: float,
) -> None:
    """aiohttp's run_app, on the gateway's runner (gateway/http_layer.py): until SIGTERM or
    SIGINT, then a graceful stop."""

    async def main() -> None:
        runner = GatewayRunner(
            app,
            handle_signals=True,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=shutdown_timeout_s,
        )
        await runner.setup()  # SIGTERM and SIGINT now end the loop (aiohttp's GracefulExit)
        try:
            await web.TCPSite(runner, host, port).start()
            log.info("serving on http://%s:%d", host, port)
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.set_event_loop(loop)
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
