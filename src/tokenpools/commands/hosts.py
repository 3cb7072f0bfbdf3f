"""The commands that run a host: the gateway (`serve`), the Envoy processor (`extproc`), the
Envoy authorization service (`authz`) and `quickstart` (an emulated vLLM with the gateway in
front of it)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from tokenpools.commands.common import fail
from tokenpools.model.config import ConfigError


class LogLines(StrEnum):
    TEXT = "text"
    JSON = "json"


def serve(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="the YAML config file")
    ] = None,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="listen port")] = 8080,
    shutdown_timeout: Annotated[float, typer.Option(help="seconds for in-flight requests")] = 30,
    kubernetes: Annotated[
        bool, typer.Option(help="read pools, entitlements and keys from the cluster")
    ] = False,
    namespace: Annotated[str, typer.Option(help="with --kubernetes")] = "default",
    log_format: Annotated[LogLines, typer.Option(help="log lines as")] = LogLines.TEXT,
    access_log: Annotated[bool, typer.Option(help="one log line per inference request")] = True,
    otel: Annotated[
        bool, typer.Option(help="OpenTelemetry spans over OTLP/HTTP (the otel extra)")
    ] = False,
) -> None:
    """Run the OpenAI-compatible admission gateway (reloads on SIGHUP and on file change)."""
    from tokenpools.gateway.server import serve as run

    if config is None and not kubernetes:
        fail("give --config FILE, or --kubernetes")
    try:
        run(
            config,
            host,
            port,
            shutdown_timeout,
            namespace if kubernetes else None,
            log_format=log_format.value,
            access_log=access_log,
            otel=otel,
        )
    except ConfigError as exc:
        fail(str(exc))


def extproc(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="the YAML config file (beside the cluster: the rest)"),
    ] = None,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gRPC port Envoy's ext_proc filter calls")] = 9002,
    metrics_port: Annotated[
        int, typer.Option(help="HTTP port of /metrics, /healthz and /readyz")
    ] = 9090,
    log_format: Annotated[LogLines, typer.Option(help="log lines as")] = LogLines.TEXT,
    access_log: Annotated[bool, typer.Option(help="one log line per inference request")] = True,
    full_duplex_answers: Annotated[
        bool,
        typer.Option(
            help="answers come FULL_DUPLEX_STREAMED though the data plane does not say so"
        ),
    ] = False,
    full_duplex_requests: Annotated[
        bool,
        typer.Option(
            help="requests' bodies come FULL_DUPLEX_STREAMED though the data plane does not say so"
        ),
    ] = False,
    kubernetes: Annotated[
        bool, typer.Option(help="read pools, entitlements, budgets and keys from the cluster")
    ] = False,
    namespace: Annotated[str, typer.Option(help="with --kubernetes: the platform's")] = "default",
) -> None:
    """Run admission as an Envoy external processor (ext_proc), before the endpoint picker."""
    _beside_envoy(
        "extproc",
        config,
        namespace if kubernetes else None,
        host,
        port,
        metrics_port,
        log_format.value,
        access_log,
        full_duplex_answers,
        full_duplex_requests,
    )


def authz(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="the YAML config file (beside the cluster: the rest)"),
    ] = None,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(help="HTTP port of Envoy's checks, /v1/models, /metrics and probes")
    ] = 9003,
    log_port: Annotated[int, typer.Option(help="gRPC port of Envoy's access-log service")] = 9004,
    settle_timeout: Annotated[
        float,
        typer.Option(help="seconds a request waits for its access-log line before it is charged"),
    ] = 3600.0,
    log_format: Annotated[LogLines, typer.Option(help="log lines as")] = LogLines.TEXT,
    access_log: Annotated[bool, typer.Option(help="one log line per inference request")] = True,
    kubernetes: Annotated[
        bool, typer.Option(help="read pools, entitlements, budgets and keys from the cluster")
    ] = False,
    namespace: Annotated[str, typer.Option(help="with --kubernetes: the platform's")] = "default",
    advertise: Annotated[
        str | None,
        typer.Option(help="HOST:PORT: this replica's access-log service, as its peers reach it"),
    ] = None,
    peers: Annotated[
        str | None,
        typer.Option(help="with --advertise: a name every replica resolves to (headless Service)"),
    ] = None,
    ticket_header: Annotated[
        bool,
        typer.Option(help="read tickets from logged request headers (Envoy Gateway, Istio)"),
    ] = False,
) -> None:
    """Run admission as Envoy's external authorization service (ext_authz), settled from
    Envoy's access log (deploy/envoy/envoy-authz.yaml)."""
    if settle_timeout <= 0:
        fail("--settle-timeout must be positive")
    if (advertise is None) != (peers is None):
        fail("give --advertise and --peers together (several replicas), or neither")
    host_part, _, port_part = (advertise or ":0").rpartition(":")
    if advertise is not None and (not host_part or not port_part.isdigit()):
        fail(f"--advertise {advertise!r}: give HOST:PORT")
    _beside_envoy(
        "authz",
        config,
        namespace if kubernetes else None,
        host,
        port,
        log_port,
        log_format.value,
        access_log,
        settle_timeout,
        None if advertise is None or peers is None else (advertise, peers),
        ticket_header,
    )


def _beside_envoy(
    package: str, config: Path | None, namespace: str | None, *options: object
) -> None:
    """`tokenpools.<package>.serve`: a host beside Envoy (extproc, authz), on a file or on the
    cluster of `namespace` with that file beside it; its extra missing or its config invalid,
    said plainly."""
    if config is None and namespace is None:
        fail("give --config FILE, or --kubernetes")
    try:
        serve = importlib.import_module(f"tokenpools.{package}").serve
    except ImportError as exc:
        fail(f"{exc}: install the extproc extra (pip install 'tokenpools[extproc]')")
    try:
        serve(config, namespace, *options)
    except ConfigError as exc:
        fail(str(exc))


def quickstart(
    port: Annotated[int, typer.Option(help="the gateway's port (0: any free one)")] = 8080,
    backend_port: Annotated[int, typer.Option(help="the emulated vLLM's port")] = 8000,
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    once: Annotated[bool, typer.Option(help="stop after the first answer")] = False,
) -> None:
    """Start an emulated vLLM and the gateway in front of it (the example config), send one
    request through, and keep serving until Ctrl-C."""
    import asyncio

    from tokenpools.event_loop import new_loop
    from tokenpools.quickstart import run as start

    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            code = runner.run(start(host, port, backend_port, once, typer.echo))
    except OSError as exc:  # a port taken
        fail(f"{exc}: choose others with --port and --backend-port")
    except KeyboardInterrupt:
        code = 0
    raise typer.Exit(code)


HOST_COMMANDS: dict[str, Callable[..., None]] = {
    "serve": serve,
    "extproc": extproc,
    "authz": authz,
    "quickstart": quickstart,
}
