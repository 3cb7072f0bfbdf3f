"""Envoy's gRPC access-log service (`envoy.access_loggers.http_grpc`): each HTTP request's line,
batched and sent off the request path once the request is over, however it ended. A line
that carries one of our tickets (in ext_authz's dynamic metadata; or, with `ticket_header`,
from a gateway that cannot put it there, as a request header it logs) ends that request: the
status, the
duration, and the usage that `json_to_metadata` (whole answers) or `sse_to_metadata` (streams)
lifted from the engine's answer into the `tokenpools` namespace. Every other line (a refusal,
GET /v1/models, a request Envoy refused itself) is not ours to settle."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import struct_pb2

from tokenpools.authz.check import METADATA_NAMESPACE, TICKET_HEADER
from tokenpools.authz.peers import Peers, owner_of
from tokenpools.authz.settlement import LoggedEnd, Tickets
from tokenpools.model.request import Usage

log = logging.getLogger("tokenpools.authz")
USAGE_NAMESPACE = "tokenpools"  # where the shipped config's metadata filters put the usage
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]  # untyped
    def __init__(
        self, tickets: Tickets, peers: Peers | None = None, ticket_header: bool = False
    ) -> None:
        """`ticket_header`: read a line's ticket from its logged request headers too, for a
        gateway that cannot put it in metadata (Envoy Gateway, Istio): there it goes on as a
        request header, which the engine sees."""
        self.tickets, self.peers, self.ticket_header = tickets, peers, ticket_header
        self.settled = 0  # lines that ended a waiting request
        self.forwarded = 0  # lines sent on to the replica that holds their ticket
        self.ignored = 0  # lines with a ticket not waiting here (sent again, or overdue)

    async def StreamAccessLogs(  # the name gRPC gives the method
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[
            als_pb2.StreamAccessLogsMessage, als_pb2.StreamAccessLogsResponse
        ],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            astray: dict[str, list[al.HTTPAccessLogEntry]] = {}
            for entry in message.http_logs.log_entry:
                try:
                    owner = self.take(entry)
                except Exception:  # one bad line must not drop the rest of the batch
                    log.exception("an access-log line could not be taken")
                    continue
                if owner is not None:
                    astray.setdefault(owner, []).append(entry)
            for owner, entries in astray.items():
                assert self.peers is not None  # take names an owner only with peers
                self.peers.send(owner, entries)
        return als_pb2.StreamAccessLogsResponse()

    def take(self, entry: al.HTTPAccessLogEntry) -> str | None:
        """End the request one line tells of, if its ticket waits here; returns the peer
        that issued its ticket, where the line must be sent on."""
        common = entry.common_properties
        ticket = _string(common.metadata.filter_metadata.get(METADATA_NAMESPACE), TICKET_HEADER)
        if ticket is None and self.ticket_header:
            ticket = entry.request.request_headers.get(TICKET_HEADER) or None
        if ticket is None:
            return None
        response = entry.response
        # Envoy answered in the engine's place after the engine had answered (an answer
        # over its buffer): the engine ran it, whatever the status says
        replaced = response.response_code_details != "via_upstream" and common.HasField(
            "time_to_first_upstream_rx_byte"
        )
        logged = LoggedEnd(
            status=response.response_code.value,
            usage=usage_of(common.metadata.filter_metadata.get(USAGE_NAMESPACE)),
            duration_s=_seconds(common, "duration"),
            ttft_s=_seconds(common, "time_to_first_downstream_tx_byte"),
            engine_status=not replaced,
        )
        if self.tickets.end_by_log(ticket, logged):
            self.settled += 1
            return None
        owner = owner_of(ticket)
        if owner is not None and self.peers is not None and self.peers.accepts(owner):
            self.forwarded += 1
            return owner
        self.ignored += 1
        log.debug("access-log line for a ticket not waiting here (sent again, or overdue)")
        return None


def usage_of(fields: struct_pb2.Struct | None) -> Usage | None:
    """The engine's usage as the metadata filters lifted it; None where the answer carried
    none, or carried counts that are not counts."""
    if fields is None:
        return None
    counts: dict[str, int] = {}
    for key in USAGE_KEYS:
        value = fields.fields.get(key)
        if value is None:
            continue
        number = value.number_value
        if not math.isfinite(number) or number < 0 or number != int(number):
            return None
        counts[key] = int(number)
    if "prompt_tokens" not in counts:
        return None
    return Usage(
        counts["prompt_tokens"], counts.get("completion_tokens", 0), counts.get("cached_tokens", 0)
    )


def _string(fields: struct_pb2.Struct | None, key: str) -> str | None:
    if fields is None or key not in fields.fields:
        return None
    return fields.fields[key].string_value or None


def _seconds(common: al.AccessLogCommon, name: str) -> float | None:
    if not common.HasField(name):
        return None
    duration = getattr(common, name)
    return float(duration.seconds + duration.nanos / 1e9)
