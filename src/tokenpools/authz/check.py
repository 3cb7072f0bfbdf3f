"""One ext_authz check: Envoy's HTTP authorization request (the client's method and path under
the filter's `path_prefix`, the headers the filter allows, the whole body) decided through the
front door, and the answer Envoy acts on. 200 lets the request on: the headers Envoy's
`allowed_upstream_headers` name go to the picker and the engine, those of
`allowed_client_headers_on_success` to the client, the ticket its access-log line settles by
into dynamic metadata (`dynamic_metadata_from_headers`: seen by no one else), and
`x-envoy-auth-headers-to-remove` strips the tenant's credential. Any other status is the
client's answer, with the headers of `allowed_client_headers`.

The header names are declared here once (`ENVOY_PATTERNS`); tests check the shipped Envoy
config against them. ext_authz cannot change the body: what the gateway would write into it
is refused instead where it matters (admission/clearing.py `unsendable`). No HTTP library."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenpools.admission import FrontDoor, Stopped
from tokenpools.admission.access_log import RequestRecord, request_id
from tokenpools.authz.settlement import Tickets
from tokenpools.control.tenancy import Caller
from tokenpools.identity import Credentials
from tokenpools.model.objectives import SET_BY_PROCESSOR
from tokenpools.openai_api import GENERATES, error_body, model_card
from tokenpools.openai_api.refusals import (
    Refusal,
    method_not_allowed,
    not_found,
    unknown_model,
)

PREFIX = "/check"  # the filter's path_prefix: the check's path is PREFIX + the client's path
GOVERNED = (*GENERATES, "/v1/embeddings")
MODELS = "/v1/models"
TICKET_HEADER = "x-tokenpools-ticket"  # into dynamic metadata; never to the client or upstream
PEER_HEADER = "x-tokenpools-peer"  # the client's address, added by Envoy (headers_to_add)
REMOVE_HEADER = "x-envoy-auth-headers-to-remove"
METADATA_NAMESPACE = "envoy.filters.http.ext_authz"  # where Envoy puts the ticket

# What the filter's matchers must let through (the shipped config is checked against this):
# upstream, the picker's and the engine's headers; to the client, on success and on refusal.
UPSTREAM_HEADERS = SET_BY_PROCESSOR
CLIENT_HEADER_PREFIXES = ("x-ratelimit-", "x-tokenpools-budget")
CLIENT_HEADERS = (
    "x-tokenpools-entitlement",
    "x-tokenpools-service-class",
    "x-request-id",
    "retry-after",
    "retry-after-ms",
    "www-authenticate",
    "content-type",
)
ENVOY_PATTERNS: dict[str, list[dict[str, str]]] = {
    "allowed_upstream_headers": [{"exact": h} for h in UPSTREAM_HEADERS],
    "allowed_client_headers": [
        *({"prefix": p} for p in CLIENT_HEADER_PREFIXES),
        *({"exact": h} for h in CLIENT_HEADERS),
    ],
    "allowed_client_headers_on_success": [
        *({"prefix": p} for p in CLIENT_HEADER_PREFIXES),
        *({"exact": h} for h in CLIENT_HEADERS[:2]),
    ],
    "dynamic_metadata_from_headers": [{"exact": TICKET_HEADER}],
}


@dataclass(frozen=True, slots=True)
class CheckRequest:
    method: str  # the client's
    path: str  # the client's, the prefix removed, the query kept
    headers: Mapping[str, str]  # matched without regard to case
    body: bytes
    peer: str | None  # the client's address, as Envoy added it


@dataclass(frozen=True, slots=True)
class Verdict:
    status: int  # 200: let on; any other: the client's answer
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class Checker:
    def __init__(
        self,
        door: FrontDoor,
        tickets: Tickets,
        finished: Callable[[RequestRecord], None],
        removed: tuple[str, ...],
    ) -> None:
        """`finished`: where a request's record goes once it has ended (a refusal's at once,
        an admission's when its ticket ends); `removed`: the headers an identified request
        loses (its credential; the data plane's own headers are set over the client's copies)."""
        self.door, self.tickets, self.finished = door, tickets, finished
        self.remove = ",".join(h for h in removed if h not in UPSTREAM_HEADERS)

    async def check(self, request: CheckRequest) -> Verdict:
        path = request.path.partition("?")[0]
        record = RequestRecord(request_id(request.headers.get("x-request-id")), "", path)
        record.method = request.method
        verdict = await self._decide(request, path, record)
        if verdict.status != 200:
            record.status = verdict.status
            self.finished(record)  # nothing was let on: the line is written now
        return verdict

    async def _decide(self, request: CheckRequest, path: str, record: RequestRecord) -> Verdict:
        where = f"{request.method} {path}"
        if path not in GOVERNED:
            return self._refuse(record, not_found(where))
        if request.method != "POST":
            return self._refuse(record, method_not_allowed(where))
        shown = Credentials(request.headers, request.peer)
        caller = await self.door.identify(record, shown, len(request.body))
        if isinstance(caller, Stopped):
            return self._refuse(record, caller.refusal)
        result = await self.door.enter(record, caller, path, request.body, task=None)
        if isinstance(result, Stopped):
            return self._refuse(record, result.refusal)
        ticket = self.tickets.issue(result.admitted, record)
        headers = {
            **result.headers,
            **result.data_plane_headers(caller.tenant),
            TICKET_HEADER: ticket,
            REMOVE_HEADER: self.remove,
        }
        return Verdict(200, headers)

    async def models(self, method: str, path: str, shown: Credentials) -> Verdict:
        """GET /v1/models (or one of them), routed by Envoy to this service itself: what
        this caller may use, as the gateway lists it."""
        record = RequestRecord(request_id(shown.headers.get("x-request-id")), method, path)
        caller = await self.door.identify(record, shown, None)
        if isinstance(caller, Stopped):
            verdict = self._refuse(record, caller.refusal)
        else:
            verdict = self._list(caller, path, record)
        record.status = verdict.status
        self.finished(record)
        return verdict

    def _list(self, caller: Caller, path: str, record: RequestRecord) -> Verdict:
        names = self.door.models(caller)
        body: dict[str, Any]
        if path == MODELS:
            body = {"object": "list", "data": [model_card(m) for m in names]}
        else:
            name = path[len(MODELS) + 1 :]
            if name not in names:
                return self._refuse(record, unknown_model(name))
            body = model_card(name)
        headers = {"content-type": "application/json", "x-request-id": record.request_id}
        return Verdict(200, headers, json.dumps(body).encode())

    def refuse(self, record: RequestRecord, r: Refusal) -> Verdict:
        """Refused before the check is read (a body declared too large): the line now."""
        verdict = self._refuse(record, r)
        record.status = r.status
        self.finished(record)
        return verdict

    def _refuse(self, record: RequestRecord, r: Refusal) -> Verdict:
        headers = {
            **r.headers,
            "content-type": "application/json",
            "x-request-id": record.request_id,
        }
        return Verdict(r.status, headers, error_body(r.message, r.kind, r.code, r.param))
