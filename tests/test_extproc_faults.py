"""Envoy and the processor failing for real, as docs/envoy.md promises: Envoy killed with
streams in flight (their leases end with the gRPC streams that carried them), the processor
stalled past Envoy's message timeout (Envoy refuses, fail closed; what the processor admitted
still ends), and Envoy's own body limit answered before the processor reads anything."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway_setup import KEYS, MODEL, config_data
from tests.servers import wait_for
from tests.stacks import Stack, stack_of
from tests.test_gateway_e2e import open_streams

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
GOLD = {"Authorization": f"Bearer {KEYS['gold']}"}


@pytest.fixture
def stack() -> Iterator[Stack]:
    yield from stack_of(config_data("http://127.0.0.1:9"), message_timeout_s=0.5)


def test_envoy_killed_with_streams_in_flight_ends_their_leases(stack: Stack) -> None:
    # kept: a stream garbage-collected would close itself, a hang-up, not what is tested
    streams = open_streams(stack.envoy, "gold", 3, max_tokens=2000)  # type: ignore[arg-type]
    assert stack.in_flight() == {"gold": 3}
    stack.envoy.proc.kill()
    stack.wait_all_ended()
    for s in streams:
        s.close()


def stall(stack: Stack, seconds: float) -> None:
    """Block the processor's event loop for `seconds`, as a stuck call would; returns once the
    block has begun."""
    stalled = threading.Event()

    def block() -> None:
        stalled.set()
        time.sleep(seconds)

    stack.loop.loop.call_soon_threadsafe(block)
    stalled.wait(5)


def test_a_processor_stalled_past_the_message_timeout_fails_closed(stack: Stack) -> None:
    url = f"{stack.envoy.url}/v1/chat/completions"
    assert httpx.post(url, json=BODY, headers=GOLD).status_code == 200
    stall(stack, 2.0)
    started = time.monotonic()
    refused = httpx.post(url, json=BODY, headers=GOLD, timeout=10)
    assert refused.status_code >= 500  # Envoy gave up on the processor: nothing passed
    assert time.monotonic() - started < 1.9  # at the message timeout, not after the stall
    assert len(stack.picker.seen) == 1
    wait_for(
        lambda: httpx.post(url, json=BODY, headers=GOLD).status_code,
        lambda status: status == 200,
        what="admitting again once the stall is over",
    )
    stack.wait_all_ended()


def test_a_processor_stalled_with_bodies_sent_full_duplex_fails_closed_at_the_idle_timeout() -> (
    None
):
    """Sent full duplex, the wait for admission is not under the message timeout (docs/envoy.md,
    "The filter"): the listener's stream idle timeout ends it, and nothing passes meanwhile."""
    config = config_data("http://127.0.0.1:9")
    options = {"request_mode": "FULL_DUPLEX_STREAMED", "stream_idle_timeout_s": 0.5}
    for stack in stack_of(config, message_timeout_s=0.5, **options):  # type: ignore[arg-type]
        url = f"{stack.envoy.url}/v1/chat/completions"
        assert httpx.post(url, json=BODY, headers=GOLD).status_code == 200
        stall(stack, 2.0)
        started = time.monotonic()
        refused = httpx.post(url, json=BODY, headers=GOLD, timeout=10)
        assert refused.status_code == 504, refused.text  # Envoy's stream timeout
        assert time.monotonic() - started < 1.9  # at the idle timeout, not after the stall
        assert len(stack.picker.seen) == 1  # the stalled request never reached the picker
        wait_for(
            lambda u=url: httpx.post(u, json=BODY, headers=GOLD).status_code,
            lambda status: status == 200,
            what="admitting again once the stall is over",
        )


def test_a_body_over_envoys_buffer_is_refused_by_envoy() -> None:
    config = config_data("http://127.0.0.1:9")
    config["gateway"]["maxBodyBytes"] = 1 << 22  # ours is larger: Envoy's limit answers
    for stack in stack_of(config, buffer_limit_bytes=64 * 1024):
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 200_000}]}
        r = httpx.post(f"{stack.envoy.url}/v1/chat/completions", json=big, headers=GOLD)
        assert r.status_code == 413
        assert stack.picker.seen == [] and stack.in_flight() == {}


def test_a_body_sent_full_duplex_over_the_processors_limit_is_refused_by_it() -> None:
    """Sent full duplex, a body is not held by Envoy: the processor counts its chunks and
    answers 413 once they pass its limit, before the picker hears of the request."""
    config = config_data("http://127.0.0.1:9")
    config["gateway"]["maxBodyBytes"] = 100_000
    for stack in stack_of(config, request_mode="FULL_DUPLEX_STREAMED"):
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 300_000}]}
        chunks = (json.dumps(big).encode()[i : i + 16_384] for i in range(0, 400_000, 16_384))
        r = httpx.post(f"{stack.envoy.url}/v1/chat/completions", content=chunks, headers=GOLD)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "body_too_large"
        assert stack.picker.seen == [] and stack.in_flight() == {}
        small = httpx.post(f"{stack.envoy.url}/v1/chat/completions", json=BODY, headers=GOLD)
        assert small.status_code == 200, small.text


@pytest.mark.parametrize("request_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_a_body_slower_than_the_message_timeout_is_still_admitted(request_mode: str) -> None:
    """A client that takes longer to send its body than Envoy's message timeout is not
    failed: the timeout runs from each message Envoy sends the processor, and in full duplex
    the answer to the headers (held until the body is whole) is not timed either."""

    def slow() -> Iterator[bytes]:
        raw = json.dumps(BODY).encode()
        yield raw[:10]
        time.sleep(1.0)  # the client's pause, twice the message timeout below
        yield raw[10:]

    config = config_data("http://127.0.0.1:9")
    for stack in stack_of(config, request_mode=request_mode, message_timeout_s=0.5):
        r = httpx.post(f"{stack.envoy.url}/v1/chat/completions", content=slow(), headers=GOLD)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("request_mode", ["NONE", "STREAMED", "BUFFERED_PARTIAL"])
def test_a_filter_that_would_pass_requests_before_their_body_is_read_fails_closed(
    request_mode: str,
) -> None:
    """A filter set to send the request's body NONE (never), STREAMED or BUFFERED_PARTIAL
    (the request goes on before the processor has read all of it) would let requests reach
    the picker unadmitted: the processor refuses every one, naming the setting."""
    for stack in stack_of(config_data("http://127.0.0.1:9"), request_mode=request_mode):
        r = httpx.post(f"{stack.envoy.url}/v1/chat/completions", json=BODY, headers=GOLD)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "extproc_misconfigured"
        assert f"request_body_mode {request_mode}" in error["message"]
        assert stack.picker.seen == [] and stack.in_flight() == {}


@pytest.mark.parametrize("request_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_a_large_body_reaches_the_engine_whole(request_mode: str) -> None:
    """300 kB of body (a long `user` field: bytes, not prompt tokens), sent on by Envoy, or
    by the processor in 64 KiB pieces when full duplex: the engine parses all of it."""
    config = config_data("http://127.0.0.1:9")
    config["gateway"]["maxBodyBytes"] = 1 << 20
    big = {**BODY, "user": "u" * 300_000}
    for stack in stack_of(config, request_mode=request_mode, buffer_limit_bytes=1 << 20):
        r = httpx.post(f"{stack.envoy.url}/v1/chat/completions", json=big, headers=GOLD)
        assert r.status_code == 200, r.text  # a cut body would not parse
        assert r.json()["usage"]["completion_tokens"] == 2
