"""One HTTP request's passage through Envoy, as the ext_proc stream shows it, phase by phase:
the request's headers (who calls: the gateway's identity rules), its buffered body (the front
door: admitted, or answered at once with the gateway's refusal), the answer's headers (its
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
from multidict import CIMultiDict

from tokenpools.admission import AdmissionRequest, Admitted, Cleared, Stopped
from tokenpools.admission.access_log import RequestRecord, request_id
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
    CHAT,
    COMPLETIONS,
    GENERATES,
    BadRequest,
    model_card,
    parse_body,
)
from tokenpools.openai_api.answer_tap import AnswerTap
from tokenpools.openai_api.refusals import retry_after

if TYPE_CHECKING:
    from tokenpools.extproc.processor import Processor

GOVERNED = (*GENERATES, "/v1/embeddings")  # admitted; anything else is answered 404
MODELS = "/v1/models"  # answered by the processor: the models this caller may use


class Flow:
    def __init__(self, processor: Processor) -> None:
        self.processor = processor
        self.record = RequestRecord("", "", "")
        self.path = ""
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.caller: Caller | None = None
        self.cleared: Cleared | None = None
        self.admitted: Admitted | None = None
        self.tap: AnswerTap | None = None
        self.status: int | None = None  # the answer's, once its headers passed
        self.done = False  # answered at once, or passed on unadmitted: nothing more to do

    # -- the request ---------------------------------------------------------------------

    async def request_headers(
        self, message: ep.HttpHeaders, remote: str | None
    ) -> ep.ProcessingResponse:
        self.headers = messages.headers_of(message)
        method = self.headers.get(":method", "")
        self.path = self.headers.get(":path", "").partition("?")[0]
        self.record.method, self.record.path = method, self.path
        self.record.request_id = request_id(self.headers.get("x-request-id"))
        models = method == "GET" and (self.path == MODELS or self.path.startswith(MODELS + "/"))
        if self.path not in GOVERNED and not models:
            return self._answer(
                404, f"{method} {self.path}: not found", "invalid_request_error", "not_found"
            )
        if method != "POST" and not models:
            return self._answer(
                405,
                f"{method} {self.path}: use POST",
                "invalid_request_error",
                "method_not_allowed",
            )
        limit = self.processor.config.gateway.max_body_bytes
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return self._answer(
                413,
                f"the body is larger than {limit} bytes",
                "invalid_request_error",
                "body_too_large",
            )
        if message.end_of_stream and not models:
            return self._answer(400, "the body is empty", "invalid_request_error", None)
        caller = await self.processor.caller_of(Credentials(self.headers, remote))
        if isinstance(caller, Refused):
            self.processor.metrics.unauthorized.labels(caller.code).inc()
            if caller.forbidden:
                return self._answer(403, caller.message, "permission_error", caller.code)
            return self._answer(
                401,
                caller.message,
                "invalid_request_error",
                caller.code,
                headers={"www-authenticate": "Bearer"},
            )
        self.caller = caller
        self.record.identified(caller)
        if models:
            return self._models(caller)
        return self.processor.identified

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
            return self._answer(
                404,
                f"model {name!r} does not exist or this key has no access to it",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return messages.reply(200, json.dumps(model_card(name)).encode(), headers)

    async def request_body(self, message: ep.HttpBody) -> ep.ProcessingResponse:
        assert self.caller is not None
        limit = self.processor.config.gateway.max_body_bytes
        if len(message.body) > limit:
            return self._answer(
                413,
                f"the body is larger than {limit} bytes",
                "invalid_request_error",
                "body_too_large",
            )
        try:
            body = parse_body(message.body, self.path)
        except BadRequest as exc:
            return self._answer(400, str(exc), "invalid_request_error", None, exc.param)
        self.record.model, self.record.stream = body["model"], bool(body.get("stream"))
        result = await self.processor.admission.clear(
            AdmissionRequest(self.caller, self.path, body)
        )
        self.record.pool, self.record.counted_prompt_tokens = result.pool, result.prompt_tokens
        if isinstance(result, Stopped):
            if result.decision is not None and result.entitlement is not None:
                self.record.decided(result.decision, result.entitlement)
            r = result.refusal
            return self._answer(r.status, r.message, r.kind, r.code, r.param, r.headers)
        self.cleared = result
        self.record.decided(result.decision, result.decision.lease.entitlement)
        self.admitted = self.processor.admission.track(result.decision, asyncio.current_task())
        stream = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.tap = AnswerTap(self.path, stream, wants_usage)
        rewritten = result.rewritten
        if stream and not wants_usage and self.path in (CHAT, COMPLETIONS):
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            rewritten = True  # always ask for usage, so a stream settles on real numbers
        upstream = {**self._data_plane_headers(result), "x-request-id": self.record.request_id}
        if not rewritten:
            return messages.request_body(upstream)
        raw = json.dumps(body, separators=(",", ":")).encode()
        upstream["content-length"] = str(len(raw))
        return messages.request_body(upstream, raw)

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
        if self.tap is None or self.admitted is None:
            return messages.response_body()
        if self.admitted.evicted:
            return self.preempted()
        sent = self.tap.feed(message.body, message.end_of_stream)
        if message.end_of_stream and self.status == 200:
            self.admitted.end(self.tap.so_far(self._prompt_tokens()))
        return messages.response_body(None if sent == message.body else sent)

    def preempted(self) -> ep.ProcessingResponse:
        """Evicted by the core for higher-priority work: the answer ends now (a stream whose
        headers have gone is reset by Envoy; otherwise the client gets a 503 to retry)."""
        return self._answer(
            503,
            "this request was preempted by higher-priority work; retry later",
            "server_error",
            "preempted",
            headers=retry_after(1.0),
        )

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

    def _answer(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> ep.ProcessingResponse:
        self.done = True
        self.record.status = status
        headers = {**(headers or {}), "x-request-id": self.record.request_id}
        return messages.answer(status, message, kind, code, param, headers)
