"""The front door every host admits through, written once: who calls (the identity rules and
their metrics), the body's size and fields, the route to a pool and the caller's layers there,
the prompt count, the admission itself, the `max_tokens` the reservation assumed written back
into the body, the access record filled as it goes, and the admitted request tracked until its
one end. A `Cleared` request (with its `Admitted`) or a `Stopped` one comes out.

A host only translates its wire to these calls and the answer back to its wire (the gateway:
aiohttp; ext_proc: Envoy's messages; LiteLLM: its hook). There are two steps because Envoy
asks about a request's headers before its body exists: `identify` (credentials, the declared
length) and `enter` (the body). A host that has both at once calls one after the other.
No HTTP library here."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenpools.admission.access_log import RequestRecord
from tokenpools.admission.admitted import Admitted, Cancellable
from tokenpools.admission.clearing import (
    cleared_headers,
    demand,
    include_usage,
    includes_usage,
    unsendable,
    write_back,
    write_priority,
)
from tokenpools.admission.metrics import AdmissionMetrics
from tokenpools.admission.runtime import AdmissionRuntime
from tokenpools.control.decisions import Admit, Reject
from tokenpools.control.tenancy import Caller, Refused
from tokenpools.identity import Authenticator, Credentials
from tokenpools.model.objectives import (
    CLASS_HEADER,
    ENTITLEMENT_HEADER,
    FAIRNESS_HEADER,
    OBJECTIVE_HEADER,
    objective_name,
)
from tokenpools.model.request import Account, RequestCost
from tokenpools.model.service_class import ServiceClass
from tokenpools.openai_api import BadRequest, parse_body
from tokenpools.openai_api.answer_tap import AnswerTap
from tokenpools.openai_api.continuation import suspendable
from tokenpools.openai_api.refusals import (
    Refusal,
    bad_request,
    refusal,
    too_large,
    unauthorized,
    unknown_model,
)
from tokenpools.tokenizing.counter import BACKEND, AskBackend

# How a host asks a pool's engine to count a prompt (a pool whose tokenizer is `backend`).
AskEngine = Callable[[str], AskBackend]


@dataclass(frozen=True, slots=True)
class Cleared:
    """Admitted: the host sends `body` to `pool` and ends `admitted` once (admitted.py)."""

    decision: Admit
    admitted: Admitted
    pool: str
    service_class: ServiceClass  # of the entitlement charged
    body: dict[str, Any]  # parsed; what was written to it (max_tokens, the usage chunk) included
    prompt_tokens: int  # as admission counted them
    rewritten: bool  # the body was written to: forward `body`, not the bytes that came
    headers: dict[str, str]  # x-ratelimit-*, the entitlement charged and its class, the budget
    stream: bool = False
    # the client asked for a stream's usage chunk itself; if not, the front door asked for it
    # on its behalf and the host keeps that chunk from it (openai_api.answer_tap.AnswerTap)
    client_usage: bool = False

    def tap(self, path: str) -> AnswerTap:
        """The reader of this request's answer, for the host that relays it."""
        return AnswerTap(path, self.stream, self.client_usage)

    def data_plane_headers(self, tenant: str) -> dict[str, str]:
        """Who the request is and how important, for the endpoint picker and the engine."""
        return {
            ENTITLEMENT_HEADER: self.headers[ENTITLEMENT_HEADER],
            CLASS_HEADER: self.headers[CLASS_HEADER],
            OBJECTIVE_HEADER: objective_name(self.pool, self.service_class),
            FAIRNESS_HEADER: tenant,
        }


@dataclass(frozen=True, slots=True)
class Stopped:
    """Refused: answer `refusal`. `decision` is None when the request never reached admission
    (a credential, a size or a field refused, a model the caller may not use)."""

    refusal: Refusal
    decision: Reject | None = None
    entitlement: str | None = None  # the layer a refusal of admission counts on: the first
    pool: str | None = None
    prompt_tokens: int | None = None


class FrontDoor:
    def __init__(
        self,
        admission: AdmissionRuntime,
        metrics: AdmissionMetrics | None = None,
        clock: Callable[[], float] = time.time,
        ask: AskEngine | None = None,
        rewrites: bool = True,
        ends: bool = True,
    ) -> None:
        """`metrics`: where identities are counted (a host that identifies no one itself, as
        LiteLLM, has none). `ask`: how the host asks a pool's engine to count (only the
        gateway reaches the engines); without it the estimate stands in. `rewrites`: the
        host can send on a body other than the client's (Envoy's ext_authz cannot: what
        would be written is refused instead where it matters, clearing.unsendable). `ends`:
        the host can end a request while it runs (ext_authz cannot: nothing it lets on is
        lent, control/gatekeeper.py)."""
        self.admission, self.metrics, self.ask = admission, metrics, ask
        self.rewrites, self.ends = rewrites, ends
        self.auth = Authenticator(admission.config.gateway, clock)

    def adopt(self) -> None:
        """The admission runtime adopted a new config: its identity rules apply from now."""
        self.auth = self.auth.adopt(self.admission.config.gateway)

    @property
    def max_body_bytes(self) -> int:
        return self.admission.config.gateway.max_body_bytes

    async def caller(self, shown: Credentials) -> Caller | Refused:
        """Who shows these credentials (identity/authenticator.py); nothing counted."""
        return await self.auth.caller(shown, self.admission.directory)

    def models(self, caller: Caller) -> list[str]:
        """The models this caller may use (GET /v1/models)."""
        return self.admission.directory.models(caller)

    def suspend_deadline_s(self, cleared: Cleared) -> float | None:
        """How long the host may keep this request suspended, if the core may suspend it
        (`Lease.resumable`: lent work and elastic work the host can resume from its text —
        `enter` said so in its cost — where the policy suspends); None: the core's taking it
        back ends it."""
        if not cleared.decision.lease.resumable:
            return None
        return self.admission.core.policy.suspend_deadline_s[cleared.service_class]

    async def identify(
        self, record: RequestRecord, shown: Credentials, declared_length: int | None
    ) -> Caller | Stopped:
        """The request's headers: a body declared too large, or a credential refused, stops
        it; else the caller, counted and written into the record."""
        if declared_length is not None and declared_length > self.max_body_bytes:
            return Stopped(too_large(self.max_body_bytes))
        caller = await self.caller(shown)
        if isinstance(caller, Refused):
            if self.metrics is not None:
                self.metrics.unauthorized.labels(caller.code).inc()
            return Stopped(unauthorized(caller))
        record.identified(caller)
        if self.metrics is not None:
            self.metrics.identified(caller)
        return caller

    async def enter(
        self,
        record: RequestRecord | None,
        caller: Caller,
        path: str,
        body: bytes | dict[str, Any],
        *,
        task: Cancellable | None,
    ) -> Cleared | Stopped:
        """The request's body (raw bytes, or one the host parsed already: LiteLLM's): cleared
        and tracked, or stopped. `path` is the OpenAI endpoint (openai_api: CHAT, ...);
        `task` is cancelled should the core evict the request (none: the host checks)."""
        if isinstance(body, bytes):
            if len(body) > self.max_body_bytes:
                return Stopped(too_large(self.max_body_bytes))
            try:
                body = parse_body(body, path)
            except BadRequest as exc:
                return Stopped(bad_request(str(exc), exc.param))
        if record is not None:
            record.model, record.stream = body["model"], bool(body.get("stream"))
        result = await self._clear(caller, path, body, task)
        if record is not None:
            record.pool, record.counted_prompt_tokens = result.pool, result.prompt_tokens
            if isinstance(result, Cleared):
                record.decided(result.decision, result.decision.lease.entitlement)
            elif result.decision is not None and result.entitlement is not None:
                record.decided(result.decision, result.entitlement)
        return result

    async def _clear(
        self, caller: Caller, path: str, body: dict[str, Any], task: Cancellable | None
    ) -> Cleared | Stopped:
        admission = self.admission
        try:
            wants = demand(path, body, admission.config.gateway.max_sequences)
        except BadRequest as exc:
            return Stopped(bad_request(str(exc), exc.param))
        model = body.get("model")
        route = admission.directory.route(caller, model)
        if route is None:
            return Stopped(unknown_model(model))
        counter = admission.counters[route.pool]
        asker = self.ask(route.pool) if self.ask is not None and counter.mode == BACKEND else None
        prompt_tokens = await counter.count(body, path, asker)
        account = Account(caller.tenant, caller.credential, str(model))
        pool = admission.pools[route.pool].pool
        if not self.rewrites:  # refused before admission: nothing reserved, nothing evicted
            first = admission.entitlements[route.entitlements[0]].ent
            budgeted = any(
                admission.budgets.applying(account, admission.entitlements[name].ent)
                for name in route.entitlements
            )
            why = unsendable(
                path, body, wants.max_tokens, budgeted, pool.scheduling_policy, first.service_class
            )
            if why is not None:
                return Stopped(why, None, route.entitlements[0], route.pool, prompt_tokens)
        resumable = suspendable(path, body, pool.chat_continuation)
        cost = RequestCost(
            prompt_tokens,
            wants.max_tokens,
            wants.sequences,
            account,
            resumable,
            endable=self.ends,
            lowerable=self.rewrites,
        )
        decision = await admission.admit(route.entitlements, cost)
        if isinstance(decision, Reject):
            first_layer = route.entitlements[0]
            return Stopped(refusal(decision), decision, first_layer, route.pool, prompt_tokens)
        client_usage = includes_usage(body)
        service_class = admission.entitlements[decision.lease.entitlement].ent.service_class
        scheduling = pool.scheduling_policy
        if self.rewrites:
            rewritten = write_back(path, body, decision, wants.max_tokens)
            rewritten = include_usage(path, body) or rewritten
            rewritten = write_priority(path, body, scheduling, service_class) or rewritten
        else:  # admitted by a later layer of another class: its engine priority, checked
            rewritten = False
            why = unsendable(path, body, wants.max_tokens, False, scheduling, service_class)
            if why is not None:  # nothing was sent
                admission.track(decision, None).end(None, refund=True)
                return Stopped(why, None, decision.lease.entitlement, route.pool, prompt_tokens)
        headers = cleared_headers(decision, admission.entitlements)
        admitted = admission.track(decision, task)
        stream = bool(body.get("stream"))
        return Cleared(
            decision,
            admitted,
            route.pool,
            service_class,
            body,
            prompt_tokens,
            rewritten,
            headers,
            stream,
            client_usage,
        )
