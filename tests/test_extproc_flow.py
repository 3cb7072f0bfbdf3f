"""The processor's flow fed Envoy's messages directly, without Envoy: how it answers a
request's body and an answer's chunks depends on the mode the data plane sends them in —
announced in the stream's protocol configuration (Envoy does), or set for data planes that do
not announce it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from tests.gateway_setup import KEYS, MODEL, config_data
from tokenpools.admission.access_log import RequestRecord
from tokenpools.extproc import Processor, messages
from tokenpools.extproc.service import ExternalProcessor
from tokenpools.model.config import parse_config
from tokenpools.model.objectives import FAIRNESS_HEADER, OBJECTIVE_HEADER

ANSWER = json.dumps(
    {
        "choices": [{"message": {"content": "hi"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
).encode()


def headers(**values: str) -> ep.HttpHeaders:
    return ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
        )
    )


def exchange(announced: int | None) -> list[ep.ProcessingRequest]:
    """One admitted request and its whole answer, as Envoy's messages."""
    first = ep.ProcessingRequest(
        request_headers=headers(
            **{
                ":method": "POST",
                ":path": "/v1/chat/completions",
                "authorization": f"Bearer {KEYS['gold']}",
            }
        )
    )
    if announced is not None:  # as Envoy announces them: both bodies' modes
        first.protocol_config.request_body_mode = pm.ProcessingMode.BUFFERED  # type: ignore[assignment]
        first.protocol_config.response_body_mode = announced  # type: ignore[assignment]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    return [
        first,
        ep.ProcessingRequest(
            request_body=ep.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)
        ),
        ep.ProcessingRequest(response_headers=headers(**{":status": "200"})),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=ANSWER, end_of_stream=True)),
    ]


async def run_streams(
    processor: Processor, messages: list[ep.ProcessingRequest]
) -> list[ep.ProcessingResponse]:
    """One gRPC stream of `messages` through a started processor; its answers."""

    async def stream() -> AsyncIterator[ep.ProcessingRequest]:
        for m in messages:
            yield m

    return [r async for r in ExternalProcessor(processor).Process(stream(), None)]  # type: ignore[arg-type]


async def run(
    processor: Processor, messages: list[ep.ProcessingRequest]
) -> list[ep.ProcessingResponse]:
    await processor.start(3600)
    try:
        return await run_streams(processor, messages)
    finally:
        await processor.stop()


@pytest.mark.parametrize(
    ("announced", "flag", "duplex"),
    [
        (None, False, False),
        (None, True, True),  # a data plane that does not announce: the flag says
        (pm.ProcessingMode.FULL_DUPLEX_STREAMED, False, True),  # announced: it wins
        (pm.ProcessingMode.STREAMED, True, False),
    ],
)
def test_an_answers_chunks_are_answered_as_its_mode_wants(
    announced: int | None, flag: bool, duplex: bool
) -> None:
    processor = Processor(
        parse_config(config_data("http://127.0.0.1:9")), access_log=False, duplex_answers=flag
    )
    records: list[RequestRecord] = []
    processor.observe.listeners.append(records.append)
    answers = asyncio.run(run(processor, exchange(announced)))
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers", "request_body", "response_headers", "response_body",
    ]  # fmt: skip
    chunk = answers[-1].response_body.response.body_mutation
    if duplex:  # every byte is sent back by the processor, the end marked
        assert chunk.streamed_response.body == ANSWER and chunk.streamed_response.end_of_stream
    else:  # passed on as it came
        assert chunk.WhichOneof("mutation") is None
    (record,) = records  # settled on the answer's usage
    assert (record.status, record.prompt_tokens, record.completion_tokens) == (200, 3, 2)


def duplex_exchange(trailers: bool, content: str) -> list[ep.ProcessingRequest]:
    """One admitted request whose body comes full duplex in chunks (its end marked by the
    last chunk, or by trailers), and its whole answer."""
    first, _, *answer = exchange(None)
    first.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED  # type: ignore[assignment]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    raw = json.dumps(body).encode()
    cut = [raw[:5], raw[5:20], *(raw[i : i + 1000] for i in range(20, len(raw), 1000))]
    chunks = [
        ep.ProcessingRequest(
            request_body=ep.HttpBody(body=c, end_of_stream=not trailers and i == len(cut) - 1)
        )
        for i, c in enumerate(cut)
    ]
    end = [ep.ProcessingRequest(request_trailers=ep.HttpTrailers())] if trailers else []
    return [first, *chunks, *end, *answer]


@pytest.mark.parametrize("trailers", [False, True])
def test_a_body_sent_full_duplex_is_admitted_whole_before_its_headers_are_answered(
    trailers: bool,
) -> None:
    processor = Processor(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
    records: list[RequestRecord] = []
    processor.observe.listeners.append(records.append)
    sent = duplex_exchange(trailers, "x" * 2000)
    answers = asyncio.run(run(processor, sent))
    kinds = [a.WhichOneof("response") for a in answers]
    pieces = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    pieces = pieces[: kinds.count("request_body")]
    ended = ["request_trailers"] if trailers else []
    # the headers' answer and the body's, both once the body is whole, in order
    assert kinds == [
        "request_headers", *["request_body"] * len(pieces), *ended,
        "response_headers", "response_body",
    ]  # fmt: skip
    mutation = answers[0].request_headers.response.header_mutation
    assert {h.header.key for h in mutation.set_headers} >= {OBJECTIVE_HEADER, FAIRNESS_HEADER}
    assert "authorization" in mutation.remove_headers
    whole = b"".join(m.request_body.body for m in sent if m.HasField("request_body"))
    assert b"".join(p.body for p in pieces) == whole  # the bytes the client sent, all of them
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [not trailers]
    (record,) = records
    assert (record.status, record.prompt_tokens, record.completion_tokens) == (200, 3, 2)


def test_modes_it_cannot_admit_under_are_refused_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    processor = Processor(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
    first, *_ = exchange(None)
    first.protocol_config.request_body_mode = pm.ProcessingMode.STREAMED  # type: ignore[assignment]

    async def twice() -> list[list[ep.ProcessingResponse]]:
        return [await run_streams(processor, [first]) for _ in range(2)]

    with caplog.at_level("ERROR", logger="tokenpools.extproc"):
        answers = asyncio.run(twice())
    for (answer,) in answers:  # each refused at its headers, before anything passed
        assert answer.immediate_response.status.code == 500
        assert json.loads(answer.immediate_response.body)["error"]["code"] == (
            "extproc_misconfigured"
        )
    said = [r for r in caplog.records if "request_body_mode STREAMED" in r.getMessage()]
    assert len(said) == 1


def test_a_misconfigured_refusal_is_logged_with_the_requests_id_method_and_path() -> None:
    processor = Processor(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
    records: list[RequestRecord] = []
    processor.observe.listeners.append(records.append)
    first, *_ = exchange(None)
    first.request_headers.headers.headers.add(key="x-request-id", raw_value=b"req-42")
    first.protocol_config.request_body_mode = pm.ProcessingMode.STREAMED  # type: ignore[assignment]
    (answer,) = asyncio.run(run_streams(processor, [first]))
    assert answer.immediate_response.status.code == 500
    (record,) = records
    assert (record.request_id, record.method, record.path, record.status) == (
        "req-42",
        "POST",
        "/v1/chat/completions",
        500,
    )


def test_a_stream_that_ends_before_any_message_writes_no_access_line() -> None:
    """Envoy opens a stream for a request it then refuses itself (a malformed one): no line
    with status 0 and empty fields; Envoy's own access log has the request."""
    processor = Processor(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
    records: list[RequestRecord] = []
    processor.observe.listeners.append(records.append)
    assert asyncio.run(run_streams(processor, [])) == []
    assert records == []


@pytest.mark.parametrize("size", [0, 1, 65_536, 65_537, 200_000])
@pytest.mark.parametrize("end", [True, False])
def test_a_body_sent_on_full_duplex_goes_in_pieces_envoy_takes(size: int, end: bool) -> None:
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    pieces = [
        r.request_body.response.body_mutation.streamed_response
        for r in messages.request_body_streamed(body, end)
    ]
    assert b"".join(p.body for p in pieces) == body
    assert all(len(p.body) <= messages.STREAMED_CHUNK_BYTES for p in pieces)
    assert len(pieces) == max(1, -(-size // messages.STREAMED_CHUNK_BYTES))
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [end]


@pytest.mark.parametrize(
    ("moved", "to", "answered", "admitted"),
    [
        (1, 0, 1, False),  # the body before the headers
        (2, 0, 1, False),
        (3, 0, 1, False),
        (3, 1, 2, False),  # the answer's body before the request's
        (3, 2, 3, True),  # the answer's body before its headers
        (2, 1, 3, False),  # an answer before the body (Envoy's own, passed), then the body
    ],
)
def test_a_message_out_of_order_is_a_protocol_error_answered_cleanly(
    moved: int, to: int, answered: int, admitted: bool
) -> None:
    """Envoy's four messages of one exchange, one moved ahead of a message it must follow:
    the stream is answered with a 500 naming the protocol error and ends there; nothing stays
    held (an admitted lease is charged, never left open) and the record says what happened."""
    processor = Processor(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
    records: list[RequestRecord] = []
    processor.observe.listeners.append(records.append)
    sent = exchange(None)
    sent.insert(to, sent.pop(moved))
    answers = asyncio.run(run(processor, sent))
    last = answers[-1].immediate_response
    assert last.status.code == 500 and b"extproc_protocol_error" in last.body
    assert len(answers) == answered  # up to the message out of order, then no more
    (record,) = records
    assert record.status == 500
    assert not processor.admission.in_flight
    assert (record.decision == "admitted") == admitted
    snap = processor.admission.snapshot(processor.admission.clock())
    assert all(e.in_flight == 0 for e in snap.entitlements.values()), "a lease stayed held"


@pytest.mark.parametrize(
    "moment", ["while an answer is sent", "while it waits", "as a message comes"]
)
def test_an_evicted_request_ends_with_the_preemption_whenever_it_is_taken(moment: str) -> None:
    """gRPC sends each answer from the handler's own task. The core's eviction must not cancel
    that task there: a handler cancelled mid-send ends without a status, and Envoy holds the
    client's stream open with nothing more to come. Whenever the request is evicted (while
    gRPC sends an answer, while the stream waits for Envoy, or as Envoy's next message
    arrives), the stream's next answer is the preemption (503 before the answer's headers),
    and the request is recorded evicted."""
    processor = Processor(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
    records: list[RequestRecord] = []
    processor.observe.listeners.append(records.append)
    messages = exchange(None)

    async def scenario() -> list[str | None]:
        await processor.start(3600)
        try:
            inbox: asyncio.Queue[ep.ProcessingRequest] = asyncio.Queue()
            waiting = asyncio.Event()  # the stream asks for a message that has not come

            async def stream() -> AsyncIterator[ep.ProcessingRequest]:
                while True:
                    if inbox.empty():
                        waiting.set()
                    yield await inbox.get()

            answers = ExternalProcessor(processor).Process(stream(), None)  # type: ignore[arg-type]
            kinds: list[str | None] = []
            sending, sent = asyncio.Event(), asyncio.get_running_loop().create_future()

            async def read() -> None:  # as gRPC does, in the handler's task
                async for answer in answers:
                    kinds.append(answer.WhichOneof("response"))
                    if answer.HasField("response_headers"):  # its send takes a while
                        sending.set()
                        await sent

            for message in messages[:2]:  # admitted: the request goes upstream
                inbox.put_nowait(message)
            reader = asyncio.create_task(read())
            await waiting.wait()  # the third message asked for
            (lease_id,) = processor.admission.in_flight
            if moment == "while an answer is sent":
                waiting.clear()
                inbox.put_nowait(messages[2])  # the answer's headers: their answer is sent
                await sending.wait()
            elif moment == "as a message comes":
                inbox.put_nowait(messages[2])  # the answer's headers, in the same turn
            processor.admission.evict(lease_id)
            sent.set_result(None)
            await reader
            return kinds
        finally:
            await processor.stop()

    kinds = asyncio.run(scenario())
    before = ["request_headers", "request_body"]
    if moment == "while an answer is sent":
        before.append("response_headers")
    assert kinds == [*before, "immediate_response"]
    (record,) = records
    assert record.evicted
    if moment != "while an answer is sent":  # nothing of the answer went: 503, to retry
        assert record.status == 503
