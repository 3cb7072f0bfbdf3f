"""One HTTP request's passage through Envoy, as the ext_proc stream shows it, phase by phase:
the request's headers (who calls: the gateway's identity rules), its body, buffered by Envoy or
gathered here from full-duplex chunks (the front door: admitted, or answered at once with the
gateway's refusal; sent full duplex, the headers are answered only then), the answer's headers (its
status decides how a failure ends the lease) and its body chunk by chunk (read for the
engine's usage, passed on), until the answer ends and the lease is settled on that usage.

A stream that stops before the answer's end (the client hung up, the upstream reset, Envoy
gave up on the processor) ends the lease by the gateway's rules (`abandon`)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from tokenpools.admission import AdmissionRequest, Admitted, Cleared, Stopped
from tokenpools.admission.access_log import RequestRecord, request_id
from tokenpools.admission.front_door import no_route
from tokenpools.control.tenancy import Caller, Refused
from tokenpools.extproc import messages
from tokenpools.identity import Credentials
from tokenpools.model.objectives import (
    CLASS_HEADER,
    ENTITLEMENT_HEADER,
    FAIRNESS_HEADER,
    OBJECTIVE_HEADER,
    objective_name,
)
from tokenpools.openai_api import (
    GENERATES,
    BadRequest,
    model_card,
    parse_body,
)
from tokenpools.openai_api.answer_tap import AnswerTap
from tokenpools.openai_api.refusals import (
    Refusal,
    bad_request,
    misconfigured,
    preempted,
    too_large,
    unauthorized,
)

INVALID = "invalid_request_error"

if TYPE_CHECKING:
    from tokenpools.extproc.processor import Processor

GOVERNED = (*GENERATES, "/v1/embeddings")  # admitted; anything else is answered 404
MODELS = "/v1/models"  # answered by the processor: the models this caller may use


class Flow:
    def __init__(self, processor: Processor) -> None:
        self.processor = processor
        self.record = RequestRecord("", "", "")
        self.path = ""
        self.caller: Caller | None = None
        self.cleared: Cleared | None = None
        self.admitted: Admitted | None = None
        self.tap: AnswerTap | None = None
        self.status: int | None = None  # the answer's, once its headers passed
        self.done = False  # answered at once, or passed on unadmitted: nothing more to do
        # the request's body (the answer's) comes FULL_DUPLEX_STREAMED: every chunk is the
        # processor's to send on; a request's headers are answered once its body is whole
        self.request_duplex = False
        self.answer_duplex = False
        self._chunks: list[bytes] = []  # the request's body so far, sent full duplex
        self._size = 0
        self.unfit: str | None = None  # why the data plane's modes cannot be admitted under

    def adopt(self, modes: messages.BodyModes) -> None:
        """The modes the data plane announced win over the processor's flags."""
        self.request_duplex, self.answer_duplex = modes.request_duplex, modes.answer_duplex
        self.unfit = modes.unfit()

    # -- the request ---------------------------------------------------------------------

    async def request_headers(
        self, message: ep.HttpHeaders, remote: str | None
    ) -> ep.ProcessingResponse | None:
        """The answer to the request's headers; None: it waits for the body (full duplex:
        the picker must not see the request before admission names its band)."""
        if self.unfit is not None:  # fail closed: nothing passes that was not admitted
            self.processor.misconfigured(self.unfit)
            return self._refuse(misconfigured(self.unfit))
        headers = messages.headers_of(message)
        method = headers.get(":method", "")
        self.path = headers.get(":path", "").partition("?")[0]
        self.record.method, self.record.path = method, self.path
        self.record.request_id = request_id(headers.get("x-request-id"))
        models = method == "GET" and (self.path == MODELS or self.path.startswith(MODELS + "/"))
        where = f"{method} {self.path}"
        if self.path not in GOVERNED and not models:
            return self._refuse(Refusal(404, f"{where}: not found", INVALID, "not_found", None, {}))
        if method != "POST" and not models:
            return self._refuse(
                Refusal(405, f"{where}: use POST", INVALID, "method_not_allowed", None, {})
            )
        limit = self.processor.config.gateway.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return self._refuse(too_large(limit))
        if message.end_of_stream and not models:
            return self._refuse(bad_request("the body is empty"))
        caller = await self.processor.caller_of(Credentials(headers, remote))
        if isinstance(caller, Refused):
            self.processor.metrics.unauthorized.labels(caller.code).inc()
            return self._refuse(unauthorized(caller))
        self.caller = caller
        self.record.identified(caller)
        if models:
            return self._models(caller)
        return None if self.request_duplex else self.processor.identified

    def _models(self, caller: Caller) -> ep.ProcessingResponse:
        """GET /v1/models (or one of them): what this caller may use, as the gateway lists it."""
        names = self.processor.admission.directory.models(caller)
        self.done, self.record.status = True, 200
        headers = {"x-request-id": self.record.request_id}
        if self.path == MODELS:
            listing = {"object": "list", "data": [model_card(m) for m in names]}
            return messages.reply(200, json.dumps(listing).encode(), headers)
        name = self.path[len(MODELS) + 1 :]
        if name not in names:
            return self._refuse(no_route(name).refusal)
        return messages.reply(200, json.dumps(model_card(name)).encode(), headers)

    async def request_body(self, message: ep.HttpBody) -> list[ep.ProcessingResponse]:
        """Buffered: the whole body in one message. Full duplex: chunk by chunk, the request
        admitted once the last has come (nothing is answered before)."""
        limit = self.processor.config.gateway.max_body_bytes
        if not self.request_duplex:
            if len(message.body) > limit:
                return [self._refuse(too_large(limit))]
            return await self._admit(message.body, trailers=False)
        self._chunks.append(message.body)
        self._size += len(message.body)
        if self._size > limit:
            return [self._refuse(too_large(limit))]
        if not message.end_of_stream:
            return []
        return await self._admit(self._whole_body(), trailers=False)

    async def request_trailers(self) -> list[ep.ProcessingResponse]:
        """A request with trailers: sent full duplex, its body ends with them."""
        if not self.request_duplex or self.cleared is not None:
            return [messages.trailers(response=False)]
        admitted = await self._admit(self._whole_body(), trailers=True)
        return [*admitted, messages.trailers(response=False)] if not self.done else admitted

    def _whole_body(self) -> bytes:
        """The chunks gathered, joined; the flow keeps no copy (it lives as long as the
        answer streams)."""
        raw = b"".join(self._chunks)
        self._chunks.clear()
        return raw

    async def _admit(self, raw: bytes, trailers: bool) -> list[ep.ProcessingResponse]:
        """The front door's decision on the whole body: the request goes on upstream with
        the data plane's headers (and its body where rewritten), or is answered now."""
        assert self.caller is not None
        try:
            body = parse_body(raw, self.path)
        except BadRequest as exc:
            return [self._refuse(bad_request(str(exc), exc.param))]
        self.record.model, self.record.stream = body["model"], bool(body.get("stream"))
        result = await self.processor.admission.clear(
            AdmissionRequest(self.caller, self.path, body)
        )
        self.record.pool, self.record.counted_prompt_tokens = result.pool, result.prompt_tokens
        if isinstance(result, Stopped):
            if result.decision is not None and result.entitlement is not None:
                self.record.decided(result.decision, result.entitlement)
            return [self._refuse(result.refusal)]
        self.cleared = result
        self.record.decided(result.decision, result.decision.lease.entitlement)
        self.admitted = self.processor.admission.track(result.decision, asyncio.current_task())
        self.tap = result.tap(self.path)
        upstream = {**self._data_plane_headers(result), "x-request-id": self.record.request_id}
        if result.rewritten:
            raw = json.dumps(body, separators=(",", ":")).encode()
        if not self.request_duplex:
            if result.rewritten:
                upstream["content-length"] = str(len(raw))
            return [messages.request_body(upstream, raw if result.rewritten else None)]
        # the headers' answer was held for this: the picker sees the admitted request (Envoy
        # drops content-length itself when the body is sent full duplex)
        headers = messages.request_headers(upstream, self.processor.removed)
        return [headers, *messages.request_body_streamed(raw, end=not trailers)]

    def _data_plane_headers(self, result: Cleared) -> dict[str, str]:
        """Who the request is and how important, for the picker and the engine."""
        assert self.caller is not None
        view = self.processor.admission.entitlements[result.decision.lease.entitlement]
        return {
            ENTITLEMENT_HEADER: result.headers[ENTITLEMENT_HEADER],
            CLASS_HEADER: result.headers[CLASS_HEADER],
            OBJECTIVE_HEADER: objective_name(result.pool, view.ent.service_class),
            FAIRNESS_HEADER: self.caller.tenant,
        }

    # -- the answer ----------------------------------------------------------------------

    def response_headers(self, message: ep.HttpHeaders) -> ep.ProcessingResponse:
        self.status = messages.status_of(message)
        if self.cleared is None or self.admitted is None:
            return messages.response_headers()
        if self.status != 200:  # the engine's own words pass on; the lease ends by its status
            self.admitted.end(None, refund=self.status != 504)  # a timeout may have run the engine
        return messages.response_headers(
            {**self.cleared.headers, "x-request-id": self.record.request_id}
        )

    def response_body(self, message: ep.HttpBody) -> ep.ProcessingResponse:
        end = message.end_of_stream
        if self.tap is None or self.admitted is None:
            return (
                messages.response_body_streamed(message.body, end)
                if self.answer_duplex
                else (messages.response_body())
            )
        if self.admitted.evicted:
            return self.preempted()
        sent = self.tap.feed(message.body, end)
        if end and self.status == 200:
            self.admitted.end(self.tap.so_far(self._prompt_tokens()))
        if self.answer_duplex:
            return messages.response_body_streamed(sent, end)
        return messages.response_body(None if sent == message.body else sent)

    def preempted(self) -> ep.ProcessingResponse:
        """Evicted by the core for higher-priority work: the answer ends now (a stream whose
        headers have gone is reset by Envoy; otherwise the client gets a 503 to retry)."""
        return self._refuse(preempted())

    # -- endings -------------------------------------------------------------------------

    def abandon(self) -> None:
        """The stream stopped before the answer's end: a client gone or an upstream reset mid
        answer is charged what streamed (or, before any answer, its whole reservation)."""
        if self.admitted is None or self.admitted.over:
            return
        complete = self.tap is not None and self.tap.complete  # gone after the last event
        if self.record.status == 0 and not complete:
            self.record.status = 499
        self.admitted.abandon(self.tap if self.status == 200 else None, self._prompt_tokens())

    def finish(self) -> RequestRecord:
        """The flow is over: nothing may stay held; the record for the log and the metrics."""
        self.abandon()
        r = self.record
        if self.admitted is not None:
            self.admitted.close()
            a = self.admitted
            r.settled(a.usage, a.charge, a.evicted)
        if r.status == 0:
            r.status = self.status or 0
        r.duration_s = time.monotonic() - r.started
        if self.tap is not None:
            r.first_token(self.tap.first_token_at)
        return r

    def _prompt_tokens(self) -> int:
        return 0 if self.cleared is None else self.cleared.prompt_tokens

    def _refuse(self, r: Refusal) -> ep.ProcessingResponse:
        """Answer the client now; the request goes no further."""
        self.done = True
        self.record.status = r.status
        headers = {**r.headers, "x-request-id": self.record.request_id}
        return messages.answer(r.status, r.message, r.kind, r.code, r.param, headers)
