"""Envoy's ext_proc messages, read and built: the headers of a `ProcessingRequest` as a
case-insensitive mapping, the client's address from its attributes, and each
`ProcessingResponse` the processor sends (continue with header and body mutations, or answer
at once). Only protobuf here; what to decide lives in flow.py."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from multidict import CIMultiDict

from tokenpools.openai_api import error_body

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_ADMITTABLE = (processing_mode_pb2.ProcessingMode.BUFFERED, _FULL_DUPLEX)
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"  # where Envoy puts the request attributes asked
# What the processor needs of Envoy's ext_proc filter (docs/envoy.md, "The filter"): the one
# declaration deploy/ and the tests' Envoy are checked against.
PROCESSING_MODE = {
    "request_header_mode": "SEND",  # who calls
    "request_body_mode": "BUFFERED",  # model, max_tokens, n, stream
    "request_trailer_mode": "SKIP",
    "response_header_mode": "SEND",  # the status ends a failed request's lease
    "response_body_mode": "STREAMED",  # usage read as chunks pass, never buffered whole
    "response_trailer_mode": "SKIP",
}


def headers_of(message: ep.HttpHeaders) -> CIMultiDict[str]:
    """The headers, names matched without regard to case; pseudo-headers (`:path`) included."""
    out: CIMultiDict[str] = CIMultiDict()
    for h in message.headers.headers:
        out.add(h.key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
    return out


def client_address(request: ep.ProcessingRequest) -> str | None:
    """The downstream peer's IP (Envoy's `source.address` attribute, `ip:port`), if sent."""
    attributes = request.attributes.get(ATTRIBUTES_KEY)
    if attributes is None or "source.address" not in attributes.fields:
        return None
    address = str(attributes.fields["source.address"].string_value)
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address or None
    return host.strip("[]")  # an IPv6 address comes bracketed


def mutation(
    set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = ()
) -> ep.HeaderMutation:
    out = ep.HeaderMutation(remove_headers=list(remove))
    add = out.set_headers.add  # filled in place: half the cost of nested constructors
    for k, v in (set_headers or {}).items():
        option = add(append_action=_OVERWRITE)
        option.header.key = k.lower()
        option.header.raw_value = v.encode()
    return out


def _common(
    set_headers: Mapping[str, str] | None = None,
    remove: Iterable[str] = (),
    body: bytes | None = None,
) -> ep.CommonResponse:
    common = ep.CommonResponse()
    if set_headers or remove:
        common.header_mutation.CopyFrom(mutation(set_headers, remove))
    if body is not None:
        common.body_mutation.body = body
    return common


def request_headers(
    set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = ()
) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=_common(set_headers, remove))
    )


def request_body(
    set_headers: Mapping[str, str] | None = None, body: bytes | None = None
) -> ep.ProcessingResponse:
    """Continue with the request: headers for the picker and the engine, and the body when it
    changed (`body`: it replaces the buffered one)."""
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=_common(set_headers, (), body))
    )


def response_headers(set_headers: Mapping[str, str] | None = None) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=_common(set_headers)))


# The answers that carry nothing of their own are built once (the processor never changes a
# message after it is built): most of an answer's chunks pass on unchanged.
_PASS_CHUNK = ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse()))


def response_body(body: bytes | None = None) -> ep.ProcessingResponse:
    """Pass an answer's chunk on, or (`body`) what replaces it."""
    if body is None:
        return _PASS_CHUNK
    return ep.ProcessingResponse(response_body=ep.BodyResponse(response=_common(body=body)))


def _streamed(body: bytes, end: bool) -> ep.BodyResponse:
    common = ep.CommonResponse()
    common.body_mutation.streamed_response.body = body
    common.body_mutation.streamed_response.end_of_stream = end
    return ep.BodyResponse(response=common)


def response_body_streamed(body: bytes, end: bool) -> ep.ProcessingResponse:
    """In FULL_DUPLEX_STREAMED mode every chunk is the processor's to send on: `body` goes
    downstream as the answer's next bytes (`end`: its last)."""
    return ep.ProcessingResponse(response_body=_streamed(body, end))


STREAMED_CHUNK_BYTES = 64 * 1024  # at most this per streamed body message, as Envoy advises


def request_body_streamed(body: bytes, end: bool) -> list[ep.ProcessingResponse]:
    """The request's body, sent on upstream by the processor (FULL_DUPLEX_STREAMED) in
    pieces of at most STREAMED_CHUNK_BYTES; `end` marks the last (False: trailers follow)."""
    cuts = range(0, len(body), STREAMED_CHUNK_BYTES) if body else range(1)
    return [
        ep.ProcessingResponse(
            request_body=_streamed(
                body[i : i + STREAMED_CHUNK_BYTES],
                end and i + STREAMED_CHUNK_BYTES >= len(body),
            )
        )
        for i in cuts
    ]


@dataclass(frozen=True)
class BodyModes:
    """How the data plane sends the request's body and the answer's, as it announces them in
    a stream's first message (ProtocolConfiguration)."""

    request: int
    answer: int

    @property
    def request_duplex(self) -> bool:
        return bool(self.request == _FULL_DUPLEX)

    @property
    def answer_duplex(self) -> bool:
        return bool(self.answer == _FULL_DUPLEX)

    def unfit(self) -> str | None:
        """Why the processor cannot admit under these modes, if it cannot: it must read the
        whole body before the request goes on (NONE would pass every request unadmitted;
        STREAMED and BUFFERED_PARTIAL send the request on before its body is whole)."""
        if self.request in _ADMITTABLE:
            return None
        name = str(processing_mode_pb2.ProcessingMode.BodySendMode.Name(self.request))
        return f"request_body_mode {name}: the processor needs BUFFERED or FULL_DUPLEX_STREAMED"


def body_modes(request: ep.ProcessingRequest) -> BodyModes | None:
    """The modes announced with a stream's first message; None: not this message."""
    if not request.HasField("protocol_config"):
        return None
    config = request.protocol_config
    return BodyModes(config.request_body_mode, config.response_body_mode)


def status_of(message: ep.HttpHeaders) -> int:
    """An answer's status (`:status`), without reading its other headers; 0 if it has none."""
    for h in message.headers.headers:
        if h.key == ":status":
            value = h.raw_value.decode() if h.raw_value else h.value
            return int(value) if value.isdigit() else 0
    return 0


def trailers(response: bool) -> ep.ProcessingResponse:
    key = "response_trailers" if response else "request_trailers"
    return ep.ProcessingResponse(**{key: ep.TrailersResponse()})


def answer(
    status: int,
    message: str,
    kind: str,
    code: str | None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> ep.ProcessingResponse:
    """Answer the client now with an OpenAI-shaped error; the request goes no further."""
    immediate = ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=mutation({"content-type": "application/json", **(headers or {})}),
        body=error_body(message, kind, code, param),
        details=f"tokenpools_{code or kind}",
    )
    return ep.ProcessingResponse(immediate_response=immediate)


def reply(
    status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> ep.ProcessingResponse:
    """Answer the client now with a JSON body of the processor's own (GET /v1/models)."""
    immediate = ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=mutation({"content-type": "application/json", **(headers or {})}),
        body=body,
    )
    return ep.ProcessingResponse(immediate_response=immediate)


def kind_of(request: ep.ProcessingRequest) -> str:
    """Which phase the message is: request_headers, request_body, response_headers, ..."""
    return str(request.WhichOneof("request"))


def message_of(request: ep.ProcessingRequest) -> Any:
    return getattr(request, kind_of(request))
