"""The ext_authz path through a real Envoy on the shipped config (deploy/envoy/envoy-authz.yaml):
what only this path does — settlement from Envoy's access log, what it refuses because it
cannot rewrite the body, the ticket's deadline when a log line never comes, a log stream
broken and sent again, failing closed. The admission outcomes it shares with ext_proc are in
tests/test_extproc.py, run on both."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import yaml
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from tests.envoy_setup import LoopThread, Picker, start_grpc
from tests.gateway_setup import FAST, KEYS, MODEL, config_data
from tests.servers import ServerThread, wait_for
from tests.stacks import Stack, authz_stack_of, start_authz_envoy
from tests.test_gateway_e2e import open_streams
from tokenpools import authz
from tokenpools.authz.log_service import AccessLogService
from tokenpools.authz.peers import Peers
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.model.config import parse_config
from tokenpools.processes import free_port, spawn_server

CHAT = [{"role": "user", "content": "hi"}]


def budget_config(limit: int = 100_000) -> dict[str, Any]:
    config = config_data("http://127.0.0.1:9")
    budget = {"name": "gold-month", "tenant": "g", "limit": limit, "lowerMaxTokens": True}
    config["budgets"] = [budget]
    return config


@pytest.fixture
def stack() -> Iterator[Stack]:
    yield from authz_stack_of(config_data("http://127.0.0.1:9"))


def post(stack: Stack, body: dict[str, Any], who: str = "gold", **headers: str) -> httpx.Response:
    headers["Authorization"] = f"Bearer {KEYS[who]}"
    return httpx.post(f"{stack.envoy.url}/v1/chat/completions", json=body, headers=headers)


def test_whole_answers_and_streams_settle_on_the_engines_usage(stack: Stack) -> None:
    log = stack.records()
    c = stack.client()
    whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)  # type: ignore[arg-type]
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    done = wait_for(lambda: list(log), lambda v: len(v) == 2, what="both settled")
    assert [(r.status, r.completion_tokens) for r in done] == [(200, 5), (200, 6)]
    assert done[0].prompt_tokens == whole.usage.prompt_tokens
    assert all(r.decision == "admitted" and r.duration_s > 0 for r in done)
    stack.wait_all_ended()
    assert len(stack.host.tickets) == 0  # type: ignore[attr-defined]


def test_the_clients_request_id_is_kept_and_answered(stack: Stack) -> None:
    log = stack.records()
    r = post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 2}, **{"x-request-id": "my-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-1"
    refused = post(stack, {"model": "nope", "messages": CHAT}, **{"x-request-id": "my-2"})
    assert refused.status_code == 404 and refused.headers["x-request-id"] == "my-2"
    done = wait_for(lambda: list(log), lambda v: len(v) == 2, what="both recorded")
    assert sorted(r.request_id for r in done) == ["my-1", "my-2"]


def test_the_ticket_reaches_neither_the_client_nor_the_engine(stack: Stack) -> None:
    r = post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200
    assert not any("ticket" in h for h in r.headers)
    seen = stack.picker.seen[-1]
    assert not any("ticket" in h for h in seen)
    assert "authorization" not in seen and "x-envoy-auth-headers-to-remove" not in seen


def test_a_stream_without_its_usage_chunk_is_charged_its_whole_reservation() -> None:
    """ext_authz cannot ask the engine for the usage chunk: an engine that sends none is
    charged what admission reserved (prompt + max_tokens), never nothing."""
    for stack in authz_stack_of(budget_config()):
        first = post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 3})
        left = int(first.headers["x-tokenpools-budget-remaining"])
        stack.wait_all_ended()
        http = httpx.Client()
        with http.stream(
            "POST",
            f"{stack.envoy.url}/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_tokens": 40, "stream": True},
            headers={"Authorization": f"Bearer {KEYS['gold']}"},
        ) as streamed:
            assert streamed.status_code == 200
            assert "usage" not in streamed.read().decode()
        stack.wait_all_ended()
        after = post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 3})
        # the stream (40 reserved, 40 generated here), then this one's reservation
        charged = left - int(after.headers["x-tokenpools-budget-remaining"])
        assert charged >= 40 + 3, charged


def test_what_the_gateway_would_write_into_the_body_is_refused_here_and_nothing_stays_held() -> (
    None
):
    for stack in authz_stack_of(budget_config(limit=1000)):
        no_ceiling = post(stack, {"model": MODEL, "messages": CHAT})
        assert no_ceiling.status_code == 400, no_ceiling.text
        assert no_ceiling.json()["error"]["param"] == "max_tokens"
        lowered = post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 5000})
        assert lowered.status_code == 429, lowered.text
        assert lowered.json()["error"]["code"] == "insufficient_quota"  # not lowered here
        assert "tokens left" in lowered.json()["error"]["message"]
        own = post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 2, "priority": -5})
        assert own.status_code == 400 and own.json()["error"]["param"] == "priority"
        assert stack.picker.seen == []  # none went on
        stack.wait_all_ended()
        fits = post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert fits.status_code == 200, fits.text  # the refused ones charged nothing
        assert int(fits.headers["x-tokenpools-budget-remaining"]) >= 1000 - 2 - 10


def test_models_are_listed_by_the_service_itself(stack: Stack) -> None:
    key = {"Authorization": f"Bearer {KEYS['gold']}"}
    listed = httpx.get(f"{stack.envoy.url}/v1/models", headers=key)
    assert listed.status_code == 200, listed.text
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    one = httpx.get(f"{stack.envoy.url}/v1/models/{MODEL}", headers=key)
    assert one.status_code == 200 and one.json()["id"] == MODEL
    assert httpx.get(f"{stack.envoy.url}/v1/models").status_code == 401
    assert stack.picker.seen == []


def test_a_client_that_hangs_up_mid_stream_ends_its_lease(stack: Stack) -> None:
    log = stack.records()
    (stream,) = open_streams(stack.envoy, "gold", 1, max_tokens=2000)  # type: ignore[arg-type]
    assert stack.in_flight() == {"gold": 1}
    stream.close()
    stack.wait_all_ended()
    (record,) = wait_for(lambda: list(log), what="the request settled")
    assert record.status == 200 and record.decision == "admitted"


def test_fails_closed_while_the_service_is_away_and_admits_once_back(stack: Stack) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    assert post(stack, body).status_code == 200
    running = stack.processor
    assert isinstance(running, authz.Running)
    ports = (running.http_port, running.grpc_port)
    stack.loop.run(running.stop(0))
    seen = len(stack.picker.seen)
    away = [post(stack, body).status_code for _ in range(5)]
    assert all(status in (503, 500) for status in away), away
    assert len(stack.picker.seen) == seen  # nothing passed unadmitted
    host = authz.Authorizer(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
    stack.host = host
    stack.processor = stack.loop.run(authz.start(host, http_port=ports[0], grpc_port=ports[1]))
    wait_for(lambda: post(stack, body).status_code, lambda s: s == 200, what="admitting again")


def test_a_lost_log_line_ends_by_the_tickets_deadline() -> None:
    """The access-log service killed: requests still go (admission is on the check), and
    each ends by its ticket's deadline, charged its reservation; nothing stays held."""
    skew = [0.0]
    config = parse_config(config_data("http://127.0.0.1:9"))
    host = authz.Authorizer(
        config, clock=lambda: time.time() + skew[0], access_log=False, settle_timeout_s=30
    )
    for stack in authz_stack_of({}, authorizer=host):
        log = stack.records()
        running = stack.processor
        assert isinstance(running, authz.Running)
        stack.loop.run(running._grpc.stop(0))  # the log service alone
        r = post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 2})
        assert r.status_code == 200
        assert stack.in_flight() == {"gold": 1} and len(host.tickets) == 1
        skew[0] = 31.0
        stack.wait_all_ended()
        (record,) = wait_for(lambda log=log: list(log), what="the request ended by its deadline")
        assert record.completion_tokens is None and record.decision == "admitted"
        assert len(host.tickets) == 0


def test_a_line_sent_again_after_a_reconnect_settles_nothing_twice(stack: Stack) -> None:
    """Envoy's lines captured as they came, then sent again on a new stream (as a logger
    that reconnects might): each request was settled once, the repeats change nothing."""
    log = stack.records()
    service = stack.host.log_service  # type: ignore[attr-defined]
    assert isinstance(service, AccessLogService)
    captured: list[Any] = []
    take = service.take
    service.take = lambda entry: (captured.append(entry), take(entry))[1]  # type: ignore[method-assign]
    for _ in range(3):
        assert post(stack, {"model": MODEL, "messages": CHAT, "max_tokens": 2}).status_code == 200
    wait_for(lambda: list(log), lambda v: len(v) == 3, what="three settled")
    settled = service.settled
    running = stack.processor
    assert isinstance(running, authz.Running)
    message = als_pb2.StreamAccessLogsMessage()
    assert len(captured) == 3  # one line per request
    message.http_logs.log_entry.extend(captured)
    with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
        send = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs
        send(iter([message, message]), timeout=10)
    assert service.settled == settled and service.ignored == 2 * 3
    assert len(log) == 3
    stack.wait_all_ended()


def test_the_command_serves_checks_and_stops_cleanly(tmp_path: Any) -> None:
    """`tokenpools authz` as a process: ready, a check admitted with its ticket and held, a
    check without a key refused, exit 0 on SIGTERM; a bad invocation names the fix."""
    path = tmp_path / "tokenpools.yaml"
    path.write_text(yaml.safe_dump(config_data("http://127.0.0.1:9")))
    logs = free_port()
    args = lambda port: ["authz", "-c", str(path), "--port", str(port), "--log-port", str(logs)]  # noqa: E731
    proc, url = asyncio.run(spawn_server(args, "/readyz", timeout_s=60))
    try:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
        key = {"Authorization": f"Bearer {KEYS['gold']}"}
        checked = httpx.post(f"{url}/check/v1/chat/completions", json=body, headers=key)
        assert checked.status_code == 200 and checked.headers["x-tokenpools-ticket"]
        held = httpx.get(f"{url}/metrics").text
        assert "tokenpools_authz_waiting 1.0" in held
        refused = httpx.post(f"{url}/check/v1/chat/completions", json=body)
        assert refused.status_code == 401 and refused.json()["error"]["code"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    done = subprocess.run(
        [sys.executable, "-m", "tokenpools.cli", "authz"], capture_output=True, text=True
    )
    assert done.returncode != 0 and "--config" in done.stderr + done.stdout


def test_a_line_that_reaches_another_replica_is_sent_on_to_the_one_that_admitted() -> None:
    """Two replicas behind one name: Envoy asks the first and logs to the second. The second
    holds no such ticket, sees that its peer issued it, and sends the line on: the request is
    settled once, by the replica that admitted it, on the engine's usage."""
    ports = {"a": free_port(), "b": free_port()}
    addresses = {f"127.0.0.1:{p}" for p in ports.values()}

    async def resolve() -> set[str]:
        return addresses

    config = parse_config(config_data("http://127.0.0.1:9"))
    a, b = (
        authz.Authorizer(config, access_log=False, peers=Peers(f"127.0.0.1:{ports[n]}", resolve))
        for n in ("a", "b")
    )
    backend = ServerThread(make_emulator(FAST, speed=1.0))
    loop = LoopThread()
    picker = Picker([f"127.0.0.1:{backend.port}"])
    picker_server, picker_port = loop.run(start_grpc(picker))
    first = loop.run(authz.start(a, http_port=0, grpc_port=ports["a"]))
    second = loop.run(authz.start(b, http_port=0, grpc_port=ports["b"]))
    envoy = start_authz_envoy(first.http_port, ports["b"], picker_port)
    try:
        log: list[Any] = []
        a.observe.listeners.append(log.append)
        r = httpx.post(
            f"{envoy.url}/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_tokens": 3},
            headers={"Authorization": f"Bearer {KEYS['gold']}"},
        )
        assert r.status_code == 200, r.text
        (record,) = wait_for(lambda: list(log), what="settled by the replica that admitted it")
        assert record.completion_tokens == 3 and record.status == 200
        assert len(a.tickets) == 0 and not a.admission.in_flight
        assert (b.log_service.forwarded, b.log_service.settled) == (1, 0)
        assert a.log_service.settled == 1
    finally:
        envoy.stop()
        for running in (first, second):
            loop.run(running.stop(0.5))
        loop.run(picker_server.stop(0))
        loop.stop()
        backend.stop()
