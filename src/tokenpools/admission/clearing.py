"""What the front door reads off a body and writes back into it, as pure functions on the
parsed body: the request's demand (the sequences it generates and its output ceiling), the
`max_tokens` the reservation assumed written back, the stream's usage chunk asked of the
engine, the engine priority of the request's class, and the headers an admitted request is
answered with.

One word per meaning here: a body's *demand* (`n`, `max_tokens`); the stream's *usage chunk*
(`stream_options.include_usage`, OpenAI's own name); *asking* is reserved for the engine's
token count (tokenizing/counter.py's `AskBackend`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenpools.control.decisions import Admit
from tokenpools.control.views import EntitlementView
from tokenpools.model.config import Config
from tokenpools.model.objectives import SET_BY_PROCESSOR, carried_priority
from tokenpools.model.pool import SchedulingPolicy
from tokenpools.model.service_class import ServiceClass
from tokenpools.openai_api import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    max_tokens,
    max_tokens_field,
    sequences,
)
from tokenpools.openai_api.refusals import (
    Refusal,
    bad_request,
    budget_headers,
    charged_headers,
    ratelimit_headers,
)


@dataclass(frozen=True, slots=True)
class Demand:
    """What a body demands of admission: the sequences it generates, and the output ceiling
    it sets (None: the entitlement's default; 0 for what generates nothing)."""

    sequences: int
    max_tokens: int | None


def demand(path: str, body: dict[str, Any], most_sequences: int) -> Demand:
    """Raises openai_api.BadRequest naming a field admission cannot take."""
    count = sequences(body, most_sequences)
    return Demand(count, 0 if path == EMBEDDINGS else max_tokens(body, path))


def write_back(path: str, body: dict[str, Any], decision: Admit, requested: int | None) -> bool:
    """Make the ceiling the reservation assumed true upstream: written where the request set
    none, or where a budget lowered it. Returns whether the body changed."""
    if requested is not None and not decision.lowered:
        return False
    body[max_tokens_field(path)] = decision.max_tokens
    return True


def includes_usage(body: dict[str, Any]) -> bool:
    """The client asked for the stream's usage chunk itself."""
    return bool((body.get("stream_options") or {}).get("include_usage"))


def include_usage(path: str, body: dict[str, Any]) -> bool:
    """A chat or completions stream always gets the engine's usage chunk, so it settles on the
    engine's counts; returns whether the body changed."""
    if not body.get("stream") or path not in (CHAT, COMPLETIONS) or includes_usage(body):
        return False
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return True


# the body field vLLM orders its waiting queue by under --scheduling-policy priority
ENGINE_PRIORITY = "priority"


def write_priority(
    path: str,
    body: dict[str, Any],
    scheduling_policy: SchedulingPolicy,
    service_class: ServiceClass,
) -> bool:
    """The engine's `priority` is the gateway's to set, never the client's (a tenant that set
    its own would jump the engine's queue): the class's on a chat or completions request to a
    pool whose engines schedule by priority; removed otherwise (vLLM in fcfs mode refuses a
    non-zero one). Returns whether the body changed."""
    value = carried_priority(scheduling_policy, service_class)
    if value is not None and path in (CHAT, COMPLETIONS):
        if body.get(ENGINE_PRIORITY) == value and type(body[ENGINE_PRIORITY]) is int:
            return False
        body[ENGINE_PRIORITY] = value
        return True
    if ENGINE_PRIORITY not in body:
        return False
    del body[ENGINE_PRIORITY]
    return True


def unsendable(
    path: str,
    body: dict[str, Any],
    requested: int | None,
    budgeted: bool,
    scheduling_policy: SchedulingPolicy,
    service_class: ServiceClass,
) -> Refusal | None:
    """For a host that sends on the client's body as it came (Envoy's ext_authz): what the
    gateway would have written into it, refused instead where going on without it would break
    a promise, before admission. `budgeted`: a budget applies to the caller; `service_class`:
    the class the request is admitted in (its first layer's before admission, the admitting
    one's after). A budget with less left than the request's ceiling refuses it (the core does
    not lower a ceiling this host cannot send: `RequestCost.lowerable`). A stream without its
    usage chunk is not refused: it settles on the engine's usage where the engine sends it
    anyway (vLLM's --enable-force-include-usage), else on its whole reservation."""
    field = max_tokens_field(path)
    if requested is None and budgeted and path != EMBEDDINGS:
        return bad_request(
            f"{field} is required: a budget applies to this request and this gateway cannot "
            "write the ceiling into the body",
            field,
        )
    wanted = carried_priority(scheduling_policy, service_class)
    if path not in (CHAT, COMPLETIONS):  # only these carry one (write_priority)
        wanted = None
    given = body.get(ENGINE_PRIORITY)
    if given == wanted and type(given) is type(wanted):
        return None
    if wanted is None:
        return bad_request("priority is set by the platform, not the request", ENGINE_PRIORITY)
    return bad_request(
        f"this pool's engines schedule by priority, which this gateway cannot write: send "
        f'"priority": {wanted} (your service class\'s)',
        ENGINE_PRIORITY,
    )


def cleared_headers(decision: Admit, entitlements: Mapping[str, EntitlementView]) -> dict[str, str]:
    """x-ratelimit-*, the entitlement charged and its class, the tightest budget."""
    return (
        ratelimit_headers(decision.quota)
        | charged_headers(entitlements, decision.lease.entitlement)
        | budget_headers(decision.budget)
    )


def removed_headers(config: Config) -> tuple[str, ...]:
    """What an identified request loses before anyone past tokenpools sees it: the data
    plane's own headers and the tenant's credential (it is tokenpools', not the engine's)."""
    trusted = config.gateway.trusted_header
    secret = () if trusted is None or trusted.secret_header is None else (trusted.secret_header,)
    return (*SET_BY_PROCESSOR, "authorization", *secret)
