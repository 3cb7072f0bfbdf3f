"""Suspend and resume through `tokenpools serve`, in front of the emulator: lent work the core
takes back keeps its client's connection and its output, resumes as a continuation when room
returns, and the client gets one answer — a stream that paused, or a whole answer that took
longer — with its usage counted once; past its deadline it ends as an eviction does."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.gateway_setup import KEYS, MODEL, admin, config_data, wait_all_ended
from tests.servers import ServerThread, wait_for
from tokenpools.emulator.server import EMULATOR
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.openai_api import CHAT, COMPLETIONS


def start_gateway(emulator: ServerThread, **policy: Any) -> ServerThread:
    return ServerThread(make_app(Gateway(parse_config(config_data(emulator.url, **policy)))))


@pytest.fixture
def gateway(emulator: ServerThread) -> Iterator[ServerThread]:
    server = start_gateway(emulator)
    yield server
    wait_all_ended(server)
    for p in admin(server, "pools").values():
        assert p["in_flight"] == 0 and p["reserved"] == {"concurrency": 0, "kv_tokens": 0}
    server.stop()


class Stream:
    """A streamed request read in a thread: its events' data, in order."""

    def __init__(
        self, server: ServerThread, who: str, path: str, body: dict[str, Any], wait: bool = True
    ) -> None:
        self.events: list[str] = []
        self.status = 0
        self.first = threading.Event()
        self.done = threading.Event()
        body = {"model": MODEL, "stream": True, **body}
        headers = {"Authorization": f"Bearer {KEYS[who]}"}
        url = server.url + path

        def read() -> None:
            with (
                httpx.Client(timeout=60) as http,
                http.stream("POST", url, json=body, headers=headers) as response,
            ):
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
            self.first.set()
            self.done.set()

        threading.Thread(target=read, daemon=True).start()
        if wait:
            self.began()

    def began(self) -> None:
        assert self.first.wait(10), "no first event"

    def chunks(self) -> list[dict[str, Any]]:
        assert self.done.wait(60), "the stream did not end"
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def chunks_raw(self) -> list[str]:
        assert self.done.wait(60), "the stream did not end"
        return self.events

    def text(self, path: str) -> str:
        out = ""
        for chunk in self.chunks():
            for choice in chunk.get("choices") or []:
                out += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        return out


def fill_with_batch(gateway: ServerThread, n: int, max_tokens: int) -> list[Stream]:
    """n lent streams, sent together (one after another, each set up in a thread of its own,
    the first could end before the last began on a loaded machine), each begun."""
    streams = [
        Stream(gateway, "batch", CHAT, {"messages": [{"role": "user", "content": "go"}],
                                        "max_tokens": max_tokens}, wait=False)
        for _ in range(n)
    ]  # fmt: skip
    for stream in streams:
        stream.began()
    return streams


def gold_asks(gateway: ServerThread, max_tokens: int) -> httpx.Response:
    return httpx.post(
        gateway.url + CHAT,
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
              "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {KEYS['gold']}"},
        timeout=30,
    )  # fmt: skip


def submitted(emulator: ServerThread) -> int:
    return int(emulator.call(lambda: emulator.app[EMULATOR].submitted))


def test_a_suspended_stream_pauses_and_resumes_into_one_answer(
    gateway: ServerThread, emulator: ServerThread
) -> None:
    streams = fill_with_batch(gateway, 7, 60)
    last = Stream(
        gateway,
        "batch",
        CHAT,
        {"messages": [{"role": "user", "content": "go"}], "max_tokens": 60,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    reply = gold_asks(gateway, 10)  # the pool is full: the newest lent request gives way
    assert reply.status_code == 200
    for s in [*streams, last]:
        assert s.text(CHAT) == "tok " * 60  # every stream whole, the suspended one too
        assert s.events.count("[DONE]") == 1
        assert not any('"error"' in e for e in s.events)
    ids = {c["id"] for c in last.chunks()}
    assert len(ids) == 1  # one answer: the continuation's chunks carry the first id
    usage = [c["usage"] for c in last.chunks() if c.get("usage")]
    assert usage == [{"prompt_tokens": usage[0]["prompt_tokens"], "completion_tokens": 60,
                      "total_tokens": usage[0]["prompt_tokens"] + 60}]  # fmt: skip
    assert submitted(emulator) == 8 + 1 + 1  # the eight, gold's, and one continuation
    wait_all_ended(gateway)
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert metric(metrics, "tokenpools_suspended_total", "batch") == 1
    # one request suspended, for as long as gold's request held its room (10 tokens)
    assert metric(metrics, "tokenpools_suspended_seconds_count", "batch") == 1
    assert 0 < metric(metrics, "tokenpools_suspended_seconds_sum", "batch") < 5
    # the continuation's prompt is the original and the text so far; the engine had most of
    # it cached (whole 16-token blocks), and prefilled the rest
    assert 1 <= metric(metrics, "tokenpools_recomputed_prompt_tokens_total", "batch") <= 16


def charged_once(
    server: ServerThread,
    counted: Callable[[], dict[str, float]],
    one: dict[str, float],
    requests: int,
    output: int,
) -> None:
    """After one batch request suspended among `requests` of `output` tokens each: the budgets
    (`counted`) count every output token once, and each prompt once, as the lone request's
    (`one`) was."""
    wait_all_ended(server)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric(metrics, "tokenpools_suspended_total", "batch") == 1
    total = requests * output
    seen = wait_for(counted, lambda c: c["output"] == total, what="output counted once")
    assert seen["input"] == requests * one["input"]


def metric(text: str, name: str, entitlement: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'entitlement="{entitlement}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} for {entitlement}")


def test_a_whole_answer_is_stitched_from_its_segments(
    gateway: ServerThread, emulator: ServerThread
) -> None:
    streams = fill_with_batch(gateway, 7, 40)
    answers: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "Once upon a time " * 20, "max_tokens": 80}

    def whole() -> None:
        answers.append(
            httpx.post(
                gateway.url + COMPLETIONS,
                json=body,
                timeout=60,
                headers={"Authorization": f"Bearer {KEYS['batch']}"},
            )
        )

    thread = threading.Thread(target=whole)
    thread.start()
    wait_for(
        lambda: admin(gateway, "entitlements")["batch"]["in_flight"],
        lambda n: n == 8,
        what="eight batch requests in flight",
    )
    wait_for(
        lambda: emulator_generated(emulator),
        lambda n: n >= 8 * 5,
        what="the batch requests under way in the engine",
    )
    assert gold_asks(gateway, 10).status_code == 200
    thread.join(60)
    (answer,) = answers
    assert answer.status_code == 200
    data = answer.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == "tok " * 80
    assert data["usage"]["completion_tokens"] == 80
    assert data["usage"]["prompt_tokens"] < 100  # the original prompt, counted once
    for s in streams:
        assert s.text(CHAT) == "tok " * 40


def emulator_generated(emulator: ServerThread) -> int:
    engine = emulator.app[EMULATOR].engine
    return int(emulator.call(lambda: sum(engine.output_tokens_by_tag().values())))


def test_past_its_deadline_a_suspended_stream_ends_with_the_preempted_event(
    emulator: ServerThread,
) -> None:
    server = start_gateway(emulator, suspendDeadlineS={"preemptible": 0.2})
    try:
        streams = fill_with_batch(server, 8, 100)  # 2 s each
        gold = [Stream(server, "gold", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 100}) for _ in range(4)]  # fmt: skip
        ended = [s for s in streams if any('"preempted"' in e for e in s.chunks_raw())]
        assert len(ended) == 4  # the four newest were suspended, and gave up after 0.2 s
        for s in streams:
            if s not in ended:
                assert s.text(CHAT) == "tok " * 100
        for g in gold:
            assert g.text(CHAT) == "tok " * 100
        wait_all_ended(server)
    finally:
        server.stop()


def test_without_suspension_taking_back_ends_the_stream(emulator: ServerThread) -> None:
    server = start_gateway(emulator, suspend=False)
    try:
        streams = fill_with_batch(server, 8, 100)
        assert gold_asks(server, 5).status_code == 200
        ended = [s for s in streams if any('"preempted"' in e for e in s.chunks_raw())]
        assert len(ended) == 1
        assert submitted(emulator) == 9  # nothing resumed
        wait_all_ended(server)
    finally:
        server.stop()


def test_a_client_that_leaves_while_suspended_leaves_nothing_behind(
    emulator: ServerThread,
) -> None:
    """Four suspended streams whose clients hang up: nothing resumes for them, every lease
    ends, and the guaranteed tenant and the other streams are served."""
    server = start_gateway(emulator)
    http = httpx.Client(timeout=30)
    try:
        older = fill_with_batch(server, 4, 200)  # outlives the hang-ups: none resumes
        newest = []
        for _ in range(4):
            request = http.build_request(
                "POST",
                server.url + CHAT,
                json={"model": MODEL, "stream": True, "max_tokens": 400,
                      "messages": [{"role": "user", "content": "go"}]},
                headers={"Authorization": f"Bearer {KEYS['batch']}"},
            )  # fmt: skip
            response = http.send(request, stream=True)
            assert next(response.iter_lines()).startswith("data: ")
            newest.append(response)
        gold = [Stream(server, "gold", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 60}) for _ in range(4)]  # fmt: skip
        before = submitted(emulator)
        for response in newest:  # suspended (the newest lent work): their clients hang up
            response.close()
        for s in older:
            assert s.text(CHAT) == "tok " * 200
        for s in gold:
            assert s.text(CHAT) == "tok " * 60
        wait_all_ended(server)
        assert submitted(emulator) == before  # no continuation for anyone who left
    finally:
        http.close()
        server.stop()


def test_suspension_on_a_redis_store_resumes_and_leaves_nothing_booked(
    emulator: ServerThread, redis_url: str, redis_client: object
) -> None:
    """The same taking back on a Redis store: the victim chosen in the store's atomic step,
    suspended here, resumed when the guaranteed request has ended."""
    data = config_data(emulator.url)
    data["state"] = {"backend": "redis", "url": redis_url, "keyPrefix": "susp"}
    server = ServerThread(make_app(Gateway(parse_config(data))))
    try:
        streams = fill_with_batch(server, 8, 50)
        assert gold_asks(server, 10).status_code == 200
        for s in streams:
            assert s.text(CHAT) == "tok " * 50
        wait_all_ended(server)
        for p in admin(server, "pools").values():
            assert p["in_flight"] == 0 and p["reserved"] == {"concurrency": 0, "kv_tokens": 0}
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric(metrics, "tokenpools_suspended_total", "batch") == 1
        assert submitted(emulator) == 8 + 1 + 1
    finally:
        server.stop()


def test_a_gateway_that_stops_ends_its_suspended_requests_at_once(
    emulator: ServerThread,
) -> None:
    """A graceful stop does not wait out a suspended request's deadline (600 s here): its
    client gets the preempted event at once, while the guaranteed streams still finish."""
    server = start_gateway(emulator, suspendDeadlineS={"preemptible": 600})
    streams = fill_with_batch(server, 8, 400)
    gold = [Stream(server, "gold", CHAT, {"messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 150}) for _ in range(4)]  # fmt: skip

    def evicted() -> float:
        return metric(httpx.get(f"{server.url}/metrics").text, "tokenpools_evicted_total", "batch")

    wait_for(evicted, lambda n: n == 4, what="four batch streams suspended")
    started = time.monotonic()
    server.stop()  # the gold streams (3 s of output) run to their end first
    assert time.monotonic() - started < 20
    for g in gold:
        assert g.text(CHAT) == "tok " * 150
    ended = [s for s in streams if any('"preempted"' in e for e in s.chunks_raw())]
    assert len(ended) >= 4  # the suspended ones (the others may be cut at the stop)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_budgets_count_what_the_clients_received(
    emulator: ServerThread, store: str, request: pytest.FixtureRequest
) -> None:
    """A suspended segment ends on its whole reservation (the store cannot know what it
    produced); the gateway then charges it what its client received: the budgets count each
    prompt once and every output token once, as the answers' usage does."""
    data = config_data(emulator.url)
    data["budgets"] = [
        {"name": f"b-{measure}", "tenant": "b", "limit": 10**9, "measure": measure}
        for measure in ("input", "output")
    ]
    if store == "redis":
        url = request.getfixturevalue("redis_url")
        data["state"] = {"backend": "redis", "url": url, "keyPrefix": "susp-budget"}
    server = ServerThread(make_app(Gateway(parse_config(data))))
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 60,
            "stream_options": {"include_usage": True}}  # fmt: skip

    def counted() -> dict[str, float]:
        budgets = admin(server, "budgets")["budgets"]
        return {b["measure"]: b["used"] + b["held"] for b in budgets}

    try:
        Stream(server, "batch", CHAT, body).chunks()  # alone: what one request is charged
        wait_all_ended(server)
        one = wait_for(counted, lambda c: c["output"] == 60, what="one request charged")
        streams = [Stream(server, "batch", CHAT, body) for _ in range(8)]
        assert gold_asks(server, 10).status_code == 200
        usage = [c["usage"] for s in streams for c in s.chunks() if c.get("usage")]
        assert len(usage) == 8 and all(u["completion_tokens"] == 60 for u in usage)
        # the suspended segment's reservation was 60 more
        charged_once(server, counted, one, requests=9, output=60)
    finally:
        server.stop()
