"""The whole path through a real Envoy, for either way tokenpools plugs into it: the ext_proc
processor (tests/envoy_setup.py builds Envoy's config) or the ext_authz service with the
access-log service (Envoy runs the shipped deploy/envoy/envoy-authz.yaml, its addresses
pointed at the test's servers). Both: an endpoint picker of the tests' own after tokenpools,
emulated vLLM backends behind it, the official openai client in front."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import yaml

from tests.envoy_setup import PICKER_MODE, Envoy, LoopThread, Picker, start_envoy, start_grpc
from tests.gateway_setup import FAST, KEYS
from tests.servers import ServerThread, wait_for
from tokenpools import authz, extproc
from tokenpools.admission.access_log import RequestRecord
from tokenpools.admission.host import AdmissionHost
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.model.config import parse_config
from tokenpools.processes import free_port

SHIPPED_AUTHZ = Path(__file__).parent.parent / "deploy" / "envoy" / "envoy-authz.yaml"


@dataclass
class Stack:
    envoy: Envoy
    processor: extproc.Running | authz.Running  # the tokenpools server Envoy calls
    host: AdmissionHost
    picker: Picker
    backends: list[ServerThread]
    loop: LoopThread

    def client(self, who: str = "gold", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.envoy.url}/v1", api_key=KEYS[who], **kw)

    def in_flight(self) -> dict[str, int]:
        snap = self.host.admission.snapshot(0.0)
        return {name: e.in_flight for name, e in snap.entitlements.items() if e.in_flight}

    def wait_all_ended(self) -> None:
        wait_for(self.in_flight, lambda v: not v, what="every lease ended")

    def records(self) -> list[RequestRecord]:
        """The access log's records, as they are written (after each request's end)."""
        seen: list[RequestRecord] = []
        self.host.observe.listeners.append(seen.append)
        return seen


def _stack(
    start_tokenpools: Any, host: AdmissionHost, start_proxy: Any, backends: int
) -> Iterator[Stack]:
    servers = [ServerThread(make_emulator(FAST, speed=1.0)) for _ in range(backends)]
    loop = LoopThread()
    picker = Picker([f"127.0.0.1:{s.port}" for s in servers])
    picker_server, picker_port = loop.run(start_grpc(picker))
    running = loop.run(start_tokenpools(host))
    envoy = start_proxy(running, picker_port)
    stack = Stack(envoy, running, host, picker, servers, loop)
    try:
        yield stack
        stack.wait_all_ended()
    finally:
        envoy.stop()
        loop.run(stack.processor.stop(0.5))
        loop.run(picker_server.stop(0))
        loop.stop()
        for s in servers:
            s.stop()


def stack_of(config: dict[str, Any], backends: int = 2, **envoy: Any) -> Iterator[Stack]:
    """The ext_proc stack of a config; `envoy`: options of Envoy's config (envoy_setup.py)."""
    processor = extproc.Processor(parse_config(config), access_log=False)
    return _stack(
        lambda host: extproc.start(host, port=0, http_port=0),
        processor,
        lambda running, picker: start_envoy(running.grpc_port, picker, **envoy),
        backends,
    )


def authz_stack_of(
    config: dict[str, Any], backends: int = 2, authorizer: authz.Authorizer | None = None
) -> Iterator[Stack]:
    """The ext_authz stack of a config, Envoy on the shipped config."""
    host = authorizer or authz.Authorizer(parse_config(config), access_log=False)
    return _stack(
        lambda h: authz.start(h, http_port=0, grpc_port=0),
        host,
        lambda running, picker: start_authz_envoy(running.http_port, running.grpc_port, picker),
        backends,
    )


def shipped_authz_config(
    listen: int, admin: int, checks: int, logs: int, picker: int, flush_s: float = 0.05
) -> dict[str, Any]:
    """deploy/envoy/envoy-authz.yaml as shipped, its addresses on loopback, the picker's
    filter in the mode of the tests' picker, and the access log flushed every `flush_s` (the
    shipped 1 s would only slow the tests)."""
    config = yaml.safe_load(SHIPPED_AUTHZ.read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
    ports = {"tokenpools-authz": checks, "tokenpools-log": logs, "endpoint-picker": picker}
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] not in ports:
            continue
        cluster["type"] = "STATIC"
        cluster.pop("transport_socket", None)  # the tests' picker serves cleartext
        for check in cluster.get("health_checks", []):
            check["interval"] = "0.5s"
        (group,) = cluster["load_assignment"]["endpoints"]
        (endpoint,) = group["lb_endpoints"]
        endpoint["endpoint"]["address"]["socket_address"] = {
            "address": "127.0.0.1",
            "port_value": ports[cluster["name"]],
        }
    (chain,) = listener["filter_chains"]
    (manager,) = chain["filters"]
    for f in manager["typed_config"]["http_filters"]:
        if f["name"] == "endpoint-picker":  # the tests' picker reads headers alone
            f["typed_config"]["processing_mode"] = PICKER_MODE
    (logger,) = manager["typed_config"]["access_log"]
    logger["typed_config"]["common_config"]["buffer_flush_interval"] = f"{flush_s}s"
    return config


def start_authz_envoy(checks: int, logs: int, picker: int, flush_s: float = 0.05) -> Envoy:
    listen, admin = free_port(), free_port()
    return Envoy(shipped_authz_config(listen, admin, checks, logs, picker, flush_s), listen, admin)
