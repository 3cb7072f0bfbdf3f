"""What crosses the boundary between Envoy and the ext_authz service, declared once
(authz/check.py) and checked against the shipped Envoy config; the settlement of each held
request, whatever order and number of log lines come; the usage the metadata filters lift."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
import yaml
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.gateway_setup import KEYS, MODEL, config_data
from tests.stacks import SHIPPED_AUTHZ
from tokenpools.authz import Authorizer
from tokenpools.authz.check import (
    ENVOY_PATTERNS,
    METADATA_NAMESPACE,
    PREFIX,
    TICKET_HEADER,
    CheckRequest,
)
from tokenpools.authz.log_service import USAGE_KEYS, USAGE_NAMESPACE, usage_of
from tokenpools.authz.peers import Peers, owner_of
from tokenpools.authz.settlement import LoggedEnd
from tokenpools.model.config import parse_config
from tokenpools.model.request import Usage

CHAT = [{"role": "user", "content": "x"}]


def shipped_filters() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load(SHIPPED_AUTHZ.read_text())
    (listener,) = config["static_resources"]["listeners"]
    (manager,) = listener["filter_chains"][0]["filters"]
    return {f["name"]: f["typed_config"] for f in manager["typed_config"]["http_filters"]}


def test_the_shipped_filter_lets_through_exactly_the_declared_headers() -> None:
    authz = shipped_filters()["tokenpools"]
    response = authz["http_service"]["authorization_response"]
    for matcher, patterns in ENVOY_PATTERNS.items():
        assert response[matcher]["patterns"] == patterns, matcher
    assert authz["http_service"]["path_prefix"] == PREFIX
    assert authz["failure_mode_allow"] is False
    assert not authz["with_request_body"]["allow_partial_message"]
    # the ticket never reaches the client or the engine
    client = response["allowed_client_headers_on_success"]["patterns"]
    upstream = response["allowed_upstream_headers"]["patterns"]
    assert not any(TICKET_HEADER.startswith(p.get("prefix", "\0")) for p in client + upstream)


def test_the_metadata_filters_write_what_the_log_service_reads() -> None:
    filters = shipped_filters()
    whole = filters["usage-json"]["response_rules"]["rules"]
    streamed = [
        r["rule"] for r in filters["usage-sse"]["response_rules"]["content_parser"]["typed_config"]
        ["rules"]
    ]  # fmt: skip
    for rules in (whole, streamed):
        written = {r["on_present"]["key"] for r in rules}
        assert {r["on_present"]["metadata_namespace"] for r in rules} == {USAGE_NAMESPACE}
        assert written <= set(USAGE_KEYS) and {"prompt_tokens", "completion_tokens"} <= written


counts = st.one_of(
    st.integers(0, 10**9).map(float),
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(-1.0),
)


@given(st.dictionaries(st.sampled_from([*USAGE_KEYS, "other"]), counts))
def test_usage_is_read_only_from_counts(fields: dict[str, float]) -> None:
    struct = struct_pb2.Struct()
    struct.update(fields)
    usage = usage_of(struct)
    ours = {k: v for k, v in fields.items() if k in USAGE_KEYS}
    valid = all(math.isfinite(v) and v >= 0 and v == int(v) for v in ours.values())
    if "prompt_tokens" not in ours or not valid:
        assert usage is None
    else:
        assert usage == Usage(
            int(ours["prompt_tokens"]),
            int(ours.get("completion_tokens", 0)),
            int(ours.get("cached_tokens", 0)),
        )


def check(authorizer: Authorizer, body: dict[str, Any], who: str = "gold") -> Any:

    headers = {"Authorization": f"Bearer {KEYS[who]}"}
    request = CheckRequest("POST", "/v1/chat/completions", headers, json.dumps(body).encode(), None)
    return authorizer.checker.check(request)


events = st.lists(
    st.tuples(
        st.sampled_from(["admit", "log", "log-again", "expire", "unknown"]),
        st.sampled_from([0, 200, 429, 500, 504]),
        st.integers(0, 5),
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(events)
def test_every_request_let_on_ends_exactly_once(steps: list[tuple[str, int, int]]) -> None:
    """Admissions, log lines (some sent again, some for tickets never held), deadlines in any
    order: each request let on ends once, its record written once, nothing stays held."""

    async def run() -> None:
        now = [1000.0]
        authorizer = Authorizer(
            parse_config(config_data("http://127.0.0.1:9")),
            clock=lambda: now[0],
            access_log=False,
            settle_timeout_s=10,
        )
        records: list[Any] = []
        authorizer.observe.listeners.append(records.append)
        await authorizer.start(3600)
        tickets: list[str] = []
        settled: set[str] = set()
        for what, status, n in steps:
            if what == "admit":
                body = {"model": MODEL, "messages": CHAT, "max_tokens": n + 1}
                waiting = len(authorizer.tickets)
                verdict = await check(authorizer, body)
                assert verdict.status == (200 if waiting < 4 else 429)  # gold's concurrency: 4
                if verdict.status == 200:
                    tickets.append(verdict.headers[TICKET_HEADER])
            elif what in ("log", "log-again") and tickets:
                ticket = tickets[n % len(tickets)]
                ended = authorizer.tickets.end_by_log(ticket, LoggedEnd(status, Usage(3, n)))
                assert ended == (ticket not in settled)
                settled.add(ticket)
            elif what == "expire":
                now[0] += 11
                authorizer.tickets.end_overdue()
                settled.update(tickets)
            elif what == "unknown":
                assert not authorizer.tickets.end_by_log("nope", LoggedEnd(200, None))
        await authorizer.stop()  # what is still held ends now
        admitted = [r for r in records if r.decision == "admitted"]
        assert len(admitted) == len(tickets)  # one record per request let on
        assert not authorizer.admission.in_flight and len(authorizer.tickets) == 0

    asyncio.run(run())


@pytest.mark.parametrize("peer", [None, "10.0.0.1"])
def test_a_check_without_a_body_or_credential_is_refused_and_holds_nothing(
    peer: str | None,
) -> None:
    async def run() -> list[int]:
        authorizer = Authorizer(parse_config(config_data("http://127.0.0.1:9")), access_log=False)
        await authorizer.start(3600)
        statuses = []
        for headers, body in [({}, b"{}"), ({"Authorization": f"Bearer {KEYS['gold']}"}, b"")]:
            request = CheckRequest("POST", "/v1/chat/completions", headers, body, peer)
            statuses.append((await authorizer.checker.check(request)).status)
        held = len(authorizer.tickets)
        await authorizer.stop()
        return [*statuses, held]

    assert asyncio.run(run()) == [401, 400, 0]


def test_a_line_is_sent_on_only_to_a_known_peer_and_never_back_to_itself() -> None:
    """A ticket names its issuer; a line for a ticket not held here goes on to that issuer
    only if it is one of the peers the name resolved to: a log line cannot make a replica
    connect anywhere else, nor send a line round in a loop."""

    async def run() -> list[str | None]:
        async def resolve() -> set[str]:
            return {"10.0.0.1:9004", "10.0.0.2:9004"}

        peers = Peers("10.0.0.1:9004", resolve)
        await peers.refresh()
        authorizer = Authorizer(
            parse_config(config_data("http://127.0.0.1:9")), access_log=False, peers=peers
        )
        service = authorizer.log_service
        owners = []
        for ticket in ("10.0.0.2:9004/abc", "10.0.0.1:9004/abc", "10.6.6.6:22/abc", "abc"):
            entry = al.HTTPAccessLogEntry()
            entry.common_properties.metadata.filter_metadata[METADATA_NAMESPACE].update(
                {TICKET_HEADER: ticket}
            )
            owners.append(service.take(entry))
        assert (service.forwarded, service.ignored) == (1, 3)
        return owners

    assert asyncio.run(run()) == ["10.0.0.2:9004", None, None, None]
    assert owner_of("10.0.0.2:9004/abc") == "10.0.0.2:9004" and owner_of("abc") is None
