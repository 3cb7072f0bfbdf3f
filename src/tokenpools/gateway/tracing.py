"""Optional OpenTelemetry tracing (the `otel` extra): one span per inference request, a child
of the client's `traceparent` when it sends one, named and described as the GenAI semantic
conventions say (`chat qwen3-8b`, gen_ai.* attributes) plus the admission decision; the
backend gets this span's context, so its own spans join the same trace.

Off unless `tokenpools serve --otel` (or OTEL_EXPORTER_OTLP_ENDPOINT set) and the extra is
installed; spans go to the OTLP/HTTP exporter the standard OTEL_* variables configure."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tokenpools.openai_api import CHAT, EMBEDDINGS, RESPONSES

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from tokenpools.admission.access_log import RequestRecord

log = logging.getLogger("tokenpools.gateway")
OPERATIONS = {CHAT: "chat", EMBEDDINGS: "embeddings", RESPONSES: "chat"}


class Tracing:
    def __init__(self, tracer: Tracer) -> None:
        from opentelemetry.propagate import extract, inject
        from opentelemetry.trace import SpanKind, set_span_in_context

        self.tracer = tracer
        self._extract, self._inject = extract, inject
        self._server_kind, self._in_context = SpanKind.SERVER, set_span_in_context

    def start(self, record: RequestRecord, headers: Mapping[str, str]) -> Span:
        operation = OPERATIONS.get(record.path, "text_completion")
        return self.tracer.start_span(
            operation,
            context=self._extract(dict(headers)),
            kind=self._server_kind,
            attributes={"gen_ai.operation.name": operation, "http.request.method": "POST"},
        )

    def headers(self, span: Span) -> dict[str, str]:
        """The trace context the backend gets: this span as its parent."""
        carrier: dict[str, str] = {}
        self._inject(carrier, context=self._in_context(span))
        return carrier

    @staticmethod
    def end(span: Span, record: RequestRecord) -> None:
        if record.model:
            span.update_name(f"{span.name} {record.model}")  # type: ignore[attr-defined]
        attributes: dict[str, Any] = {
            "gen_ai.request.model": record.model,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "http.response.status_code": record.status,
            "tokenpools.request_id": record.request_id,
            "tokenpools.entitlement": record.entitlement,
            "tokenpools.pool": record.pool,
            "tokenpools.decision": record.decision,
            "tokenpools.reason": record.reason,
            "tokenpools.counted_prompt_tokens": record.counted_prompt_tokens,
        }
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if record.status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR))
        span.end()


def otlp_tracing() -> Tracing | None:
    """Tracing to the OTLP/HTTP endpoint of the OTEL_* environment; None, said once, when the
    extra is missing."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("tracing is off: it needs the otel extra (pip install 'tokenpools[otel]')")
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "tokenpools-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return Tracing(provider.get_tracer("tokenpools"))
