"""One HTTP request's passage through Envoy, as the ext_proc stream shows it: a state machine
whose phase says which message may come next, and a (phase, message kind) table that says
what each does. Any other message is out of order: a protocol error, answered cleanly.

    HEADERS  --request_headers-->  BODY       identified (GET /v1/models: answered, DONE)
    BODY     --request_body----->  UPSTREAM   admitted through the front door and sent on;
                                              full duplex: chunks gathered until the last
    BODY     --response_headers->  LOCAL      Envoy answered itself (a body over its buffer):
                                              passed on, nothing admitted
    UPSTREAM --response_headers->  ANSWER     its status decides how a failure ends the lease
    ANSWER   --response_body---->  ANSWER     read for the engine's usage, passed on; the
                                              last chunk settles the lease on that usage
    any refusal                 ->  DONE       answered at once: the stream ends
    evicted (any message next)  ->  DONE       the preemption: 503 before the answer's
                                              headers, Envoy resets the stream after them

A stream that stops before the answer's end (the client hung up, the upstream reset, Envoy
gave up on the processor) ends the lease by the gateway's rules (`abandon`). The flow knows
the front door, its settings and nothing of the processor around it."""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from tokenpools.admission import Cleared, FrontDoor, Stopped
from tokenpools.admission.access_log import RequestRecord, request_id
from tokenpools.control.tenancy import Caller
from tokenpools.extproc import messages
from tokenpools.identity import Credentials
from tokenpools.openai_api import GENERATES, model_card
from tokenpools.openai_api.answer_tap import AnswerTap
from tokenpools.openai_api.refusals import (
    Refusal,
    bad_request,
    method_not_allowed,
    misconfigured,
    not_found,
    preempted,
    unknown_model,
)

GOVERNED = (*GENERATES, "/v1/embeddings")  # admitted; anything else is answered 404
MODELS = "/v1/models"  # answered by the processor: the models this caller may use
Answers = list[ep.ProcessingResponse]


class Phase(enum.Enum):
    HEADERS = "before the request's headers"
    BODY = "before the request's body"
    UPSTREAM = "before the answer's headers"
    ANSWER = "before the answer's end"
    LOCAL = "during Envoy's own answer"  # given before admission (a body over its buffer)
    DONE = "after the answer"


@dataclass(frozen=True)
class FlowSettings:
    """What every flow of one config shares: the body modes the processor assumes until the
    data plane announces its own, the headers an identified request loses (and the answer to
    its headers built once from them), and where a misconfigured data plane is reported."""

    request_duplex: bool
    answer_duplex: bool
    removed: tuple[str, ...]
    identified: ep.ProcessingResponse
    misconfigured: Callable[[str], None]


class Waker:
    """What evicting an admitted flow cancels: the stream's task, and only while the stream
    waits for Envoy's next message (service.py arms it there). A cancellation anywhere else
    could land inside gRPC's own send of an answer, which ends the handler without a status:
    Envoy would hold the client's stream open with nothing more to come. Evicted at any other
    moment, the stream sees it before it reads on."""

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.waiting = False

    def cancel(self) -> bool:
        return self.waiting and self.task is not None and self.task.cancel()


class Flow:
    def __init__(self, door: FrontDoor, settings: FlowSettings) -> None:
        self.door, self.settings = door, settings
        self.phase = Phase.HEADERS
        self.record = RequestRecord("", "", "")
        self.path = ""
        self.caller: Caller | None = None  # from BODY on
        self.cleared: Cleared | None = None  # from UPSTREAM on
        self.tap: AnswerTap | None = None  # from UPSTREAM on
        self.status: int | None = None  # the answer's, from ANSWER on
        # the request's body (the answer's) comes FULL_DUPLEX_STREAMED: every chunk is the
        # processor's to send on; a request's headers are answered once its body is whole
        self.request_duplex, self.answer_duplex = settings.request_duplex, settings.answer_duplex
        self._chunks: list[bytes] = []  # the request's body so far, sent full duplex
        self._size = 0
        self.unfit: str | None = None  # why the data plane's modes cannot be admitted under
        self.waker: Waker | None = None  # from UPSTREAM on

    @property
    def done(self) -> bool:
        """Answered at once: nothing more to do, the stream ends."""
        return self.phase is Phase.DONE

    @property
    def evicted(self) -> bool:
        """The core took the admitted request back: its answer ends now."""
        return self.cleared is not None and self.cleared.admitted.evicted

    async def receive(self, request: ep.ProcessingRequest) -> Answers:
        """What to send back for one message: mostly one answer; none while a request's body
        comes full duplex, two (its headers' and its body's) once it is whole."""
        if self.evicted:  # whatever comes next, the answer ends now
            return [self.preempted()]
        modes = messages.body_modes(request)
        if modes is not None:  # the modes the data plane announced win over the settings
            self.request_duplex, self.answer_duplex = modes.request_duplex, modes.answer_duplex
            self.unfit = modes.unfit()
        kind = messages.kind_of(request)
        step = _STEPS.get((self.phase, kind))
        if step is None:
            return [self._refuse(_out_of_order(kind, self.phase))]
        return await step(self, request)

    # -- the request ---------------------------------------------------------------------

    async def _request_headers(self, request: ep.ProcessingRequest) -> Answers:
        """Answered now, or (full duplex) once the body is whole: the picker must not see the
        request before admission names its band."""
        message = request.request_headers
        headers = messages.headers_of(message)
        method = headers.get(":method", "")
        self.path = headers.get(":path", "").partition("?")[0]
        self.record.method, self.record.path = method, self.path
        self.record.request_id = request_id(headers.get("x-request-id"))
        if self.unfit is not None:  # fail closed: nothing passes that was not admitted
            self.settings.misconfigured(self.unfit)
            return [self._refuse(misconfigured(self.unfit))]
        models = method == "GET" and (self.path == MODELS or self.path.startswith(MODELS + "/"))
        where = f"{method} {self.path}"
        if self.path not in GOVERNED and not models:
            return [self._refuse(not_found(where))]
        if method != "POST" and not models:
            return [self._refuse(method_not_allowed(where))]
        length = headers.get("content-length", "")
        declared = int(length) if length.isdigit() else None
        too_large = declared is not None and declared > self.door.max_body_bytes
        if message.end_of_stream and not models and not too_large:  # 413 comes first
            return [self._refuse(bad_request("the body is empty"))]
        shown = Credentials(headers, messages.client_address(request))
        caller = await self.door.identify(self.record, shown, declared)
        if isinstance(caller, Stopped):
            return [self._refuse(caller.refusal)]
        self.caller = caller
        if models:
            return [self._models(caller)]
        self.phase = Phase.BODY
        return [] if self.request_duplex else [self.settings.identified]

    def _models(self, caller: Caller) -> ep.ProcessingResponse:
        """GET /v1/models (or one of them): what this caller may use, as the gateway lists it."""
        names = self.door.models(caller)
        body: dict[str, Any]
        if self.path == MODELS:
            body = {"object": "list", "data": [model_card(m) for m in names]}
        else:
            name = self.path[len(MODELS) + 1 :]
            if name not in names:
                return self._refuse(unknown_model(name))
            body = model_card(name)
        self.phase, self.record.status = Phase.DONE, 200
        headers = {"x-request-id": self.record.request_id}
        return messages.reply(200, json.dumps(body).encode(), headers)

    async def _request_body(self, request: ep.ProcessingRequest) -> Answers:
        """Buffered: the whole body in one message. Full duplex: chunk by chunk, the request
        admitted once the last has come (nothing is answered before)."""
        message = request.request_body
        if not self.request_duplex:
            return await self._admit(message.body, trailers=False)
        self._chunks.append(message.body)
        self._size += len(message.body)
        if self._size > self.door.max_body_bytes:  # not kept waiting for the rest
            return await self._admit(b"".join(self._chunks), trailers=False)
        if not message.end_of_stream:
            return []
        return await self._admit(self._whole_body(), trailers=False)

    async def _request_trailers(self, request: ep.ProcessingRequest) -> Answers:
        """A request with trailers: sent full duplex, its body ends with them."""
        if not self.request_duplex:
            return [messages.trailers(response=False)]
        admitted = await self._admit(self._whole_body(), trailers=True)
        return admitted if self.done else [*admitted, messages.trailers(response=False)]

    async def _pass_request_trailers(self, request: ep.ProcessingRequest) -> Answers:
        return [messages.trailers(response=False)]

    def _whole_body(self) -> bytes:
        """The chunks gathered, joined; the flow keeps no copy (it lives as long as the
        answer streams)."""
        raw = b"".join(self._chunks)
        self._chunks.clear()
        return raw

    async def _admit(self, raw: bytes, trailers: bool) -> Answers:
        """The front door's decision on the whole body: the request goes on upstream with
        the data plane's headers (and its body where rewritten), or is answered now."""
        assert self.caller is not None  # the BODY phase's
        self.waker = Waker(asyncio.current_task())
        result = await self.door.enter(self.record, self.caller, self.path, raw, task=self.waker)
        if isinstance(result, Stopped):
            return [self._refuse(result.refusal)]
        self.cleared, self.phase = result, Phase.UPSTREAM
        self.tap = result.tap(self.path)
        assert self.caller is not None
        upstream = {
            **result.data_plane_headers(self.caller.tenant),
            "x-request-id": self.record.request_id,
        }
        if result.rewritten:
            raw = json.dumps(result.body, separators=(",", ":")).encode()
        if not self.request_duplex:
            if result.rewritten:
                upstream["content-length"] = str(len(raw))
            return [messages.request_body(upstream, raw if result.rewritten else None)]
        # the headers' answer was held for this: the picker sees the admitted request (Envoy
        # drops content-length itself when the body is sent full duplex)
        headers = messages.request_headers(upstream, self.settings.removed)
        return [headers, *messages.request_body_streamed(raw, end=not trailers)]

    # -- the answer ----------------------------------------------------------------------

    async def _response_headers(self, request: ep.ProcessingRequest) -> Answers:
        assert self.cleared is not None  # the UPSTREAM phase's
        self.status = messages.status_of(request.response_headers)
        self.phase = Phase.ANSWER
        if self.status != 200:  # the engine's own words pass on; the lease ends by its status
            self.cleared.admitted.end(None, refund=self.status != 504)  # 504: it may have run
        headers = {**self.cleared.headers, "x-request-id": self.record.request_id}
        return [messages.response_headers(headers)]

    async def _local_headers(self, request: ep.ProcessingRequest) -> Answers:
        self.status, self.phase = messages.status_of(request.response_headers), Phase.LOCAL
        return [messages.response_headers()]

    async def _local_body(self, request: ep.ProcessingRequest) -> Answers:
        message = request.response_body
        if self.answer_duplex:
            return [messages.response_body_streamed(message.body, message.end_of_stream)]
        return [messages.response_body()]

    async def _response_body(self, request: ep.ProcessingRequest) -> Answers:
        assert self.cleared is not None and self.tap is not None  # the ANSWER phase's
        message = request.response_body
        end = message.end_of_stream
        sent = self.tap.feed(message.body, end)
        if end and self.status == 200:
            self.cleared.admitted.end(self.tap.so_far(self.cleared.prompt_tokens))
        if self.answer_duplex:
            return [messages.response_body_streamed(sent, end)]
        return [messages.response_body(None if sent == message.body else sent)]

    async def _response_trailers(self, request: ep.ProcessingRequest) -> Answers:
        return [messages.trailers(response=True)]

    def preempted(self) -> ep.ProcessingResponse:
        """Evicted by the core for higher-priority work: the answer ends now (a stream whose
        headers have gone is reset by Envoy; otherwise the client gets a 503 to retry)."""
        return self._refuse(preempted())

    # -- endings -------------------------------------------------------------------------

    def abandon(self) -> None:
        """The stream stopped before the answer's end: a client gone or an upstream reset mid
        answer is charged what streamed (or, before any answer, its whole reservation)."""
        if self.cleared is None or self.cleared.admitted.over:
            return
        complete = self.tap is not None and self.tap.complete  # gone after the last event
        if self.record.status == 0 and not complete:
            self.record.status = 499
        tap = self.tap if self.status == 200 else None
        self.cleared.admitted.abandon(tap, self.cleared.prompt_tokens)

    def finish(self) -> RequestRecord | None:
        """The flow is over: nothing may stay held; the record for the log and the metrics.
        None: the stream ended before any message (Envoy refused a malformed request itself:
        its own access log has it)."""
        self.abandon()
        r = self.record
        if not r.method and r.status == 0:
            return None
        if self.cleared is not None:
            a = self.cleared.admitted
            a.close()
            r.settled(a.usage, a.charge, a.evicted)
        if r.status == 0:
            r.status = self.status or 0
        r.duration_s = time.monotonic() - r.started
        if self.tap is not None:
            r.first_token(self.tap.first_token_at)
        return r

    def _refuse(self, r: Refusal) -> ep.ProcessingResponse:
        """Answer the client now; the request goes no further."""
        self.phase = Phase.DONE
        self.record.status = r.status
        headers = {**r.headers, "x-request-id": self.record.request_id}
        return messages.answer(r.status, r.message, r.kind, r.code, r.param, headers)


def _out_of_order(kind: str, phase: Phase) -> Refusal:
    message = f"the ext_proc stream sent {kind} {phase.value}: a protocol error"
    return Refusal(500, message, "server_error", "extproc_protocol_error", None, {})


Step = Callable[[Flow, ep.ProcessingRequest], Awaitable[Answers]]
# What each message does in each phase; a message not listed is out of order.
_STEPS: dict[tuple[Phase, str], Step] = {
    (Phase.HEADERS, "request_headers"): Flow._request_headers,
    (Phase.BODY, "request_body"): Flow._request_body,
    (Phase.BODY, "request_trailers"): Flow._request_trailers,
    (Phase.BODY, "response_headers"): Flow._local_headers,
    (Phase.LOCAL, "response_body"): Flow._local_body,
    (Phase.LOCAL, "response_trailers"): Flow._response_trailers,
    (Phase.UPSTREAM, "request_trailers"): Flow._pass_request_trailers,
    (Phase.UPSTREAM, "response_headers"): Flow._response_headers,
    (Phase.ANSWER, "request_trailers"): Flow._pass_request_trailers,
    (Phase.ANSWER, "response_body"): Flow._response_body,
    (Phase.ANSWER, "response_trailers"): Flow._response_trailers,
}
