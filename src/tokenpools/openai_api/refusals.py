"""How a refusal is answered in OpenAI's shape, whichever server answers it (the gateway, a
LiteLLM proxy through tokenpools.integrations.litellm, Envoy through ext_proc): the status, the
error body's fields, Retry-After; and the headers of every decision (x-ratelimit-*, the
entitlement charged, the tightest budget). No HTTP library."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote

from tokenpools.control.decisions import Quota, Reason, Reject
from tokenpools.control.tenancy import Refused
from tokenpools.control.views import EntitlementView
from tokenpools.model.objectives import CLASS_HEADER, ENTITLEMENT_HEADER

NOT_RETRYABLE = {
    Reason.EXCEEDS_ENTITLEMENT: 400,
    Reason.EXCEEDS_POOL: 400,
    Reason.ENTITLEMENT_EXPIRED: 403,
    Reason.UNKNOWN_ENTITLEMENT: 401,
}


@dataclass(frozen=True)
class Refusal:
    """How a refusal is answered over HTTP, whichever server answers it (this gateway, or a
    LiteLLM proxy through tokenpools.integrations.litellm)."""

    status: int
    message: str
    kind: str
    code: str | None  # None: OpenAI's null code (a field it cannot read)
    param: str | None
    headers: dict[str, str]


def refusal(decision: Reject) -> Refusal:
    status = NOT_RETRYABLE.get(decision.reason)
    message = f"{decision.message} ({decision.reason.value})"
    code = decision.reason.value
    if decision.reason == Reason.INSUFFICIENT_QUOTA:  # OpenAI's shape for an exhausted quota
        headers = {"x-tokenpools-budget": decision.budget or ""}
        if decision.retry_after_s is not None:  # until the window resets; lifetime: never
            headers |= retry_after(decision.retry_after_s)
        return Refusal(429, message, "insufficient_quota", code, None, headers)
    if decision.reason == Reason.STORE_UNAVAILABLE:
        headers = retry_after(decision.retry_after_s or 1.0)
        return Refusal(503, message, "server_error", code, None, headers)
    if status is not None:
        kind = "invalid_request_error" if status == 400 else "permission_error"
        param = "max_tokens" if status == 400 else None
        return Refusal(status, message, kind, code, param, {})
    wait = decision.retry_after_s if decision.retry_after_s is not None else 60.0
    headers = retry_after(wait) | ratelimit_headers(decision.quota)
    return Refusal(429, message, "rate_limit_exceeded", code, None, headers)


def unauthorized(why: Refused) -> Refusal:
    """A credential refused (identity/authenticator.py): 401, or 403 for a tenant with nothing
    here."""
    if why.forbidden:
        return Refusal(403, why.message, "permission_error", why.code, None, {})
    bearer = {"WWW-Authenticate": "Bearer"}
    return Refusal(401, why.message, "invalid_request_error", why.code, None, bearer)


def too_large(limit: int) -> Refusal:
    return Refusal(
        413, f"the body is larger than {limit} bytes", "invalid_request_error", "body_too_large",
        None, {},
    )  # fmt: skip


def bad_request(message: str, param: str | None = None) -> Refusal:
    """A body the API cannot take (openai_api.BadRequest); OpenAI's code is null."""
    return Refusal(400, message, "invalid_request_error", None, param, {})


def unknown_model(model: object) -> Refusal:
    """A model that does not exist, or one this caller may not use: the same answer."""
    message = f"model {model!r} does not exist or this key has no access to it"
    return Refusal(404, message, "invalid_request_error", "model_not_found", "model", {})


def not_found(where: str) -> Refusal:
    """A path the processor does not serve (`where`: the method and path)."""
    return Refusal(404, f"{where}: not found", "invalid_request_error", "not_found", None, {})


def method_not_allowed(where: str) -> Refusal:
    message = f"{where}: use POST"
    return Refusal(405, message, "invalid_request_error", "method_not_allowed", None, {})


def preempted() -> Refusal:
    """An admitted request the core evicted for higher-priority work (preemptible only)."""
    message = "this request was preempted by higher-priority work; retry later"
    return Refusal(503, message, "server_error", "preempted", None, retry_after(1.0))


def misconfigured(why: str) -> Refusal:
    """The data plane calls the ext_proc processor in a way it cannot admit under (a body
    mode that lets requests on before their body is read): refused, failing closed."""
    message = f"the gateway's ext_proc filter is misconfigured: {why}"
    return Refusal(500, message, "server_error", "extproc_misconfigured", None, {})


def retry_after(wait: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(round(wait * 1000))}


def ratelimit_headers(q: Quota | None) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers, numeric; none when the decision read no counters (the
    shared store was unreachable)."""
    if q is None or not math.isfinite(q.limit_requests + q.limit_tokens):
        return {}
    return {
        "x-ratelimit-limit-requests": str(int(q.limit_requests)),
        "x-ratelimit-remaining-requests": str(int(q.remaining_requests)),
        "x-ratelimit-reset-requests": f"{q.reset_requests_s:.3f}s",
        "x-ratelimit-limit-tokens": str(int(q.limit_tokens)),
        "x-ratelimit-remaining-tokens": str(int(q.remaining_tokens)),
        "x-ratelimit-reset-tokens": f"{q.reset_tokens_s:.3f}s",
    }


def budget_headers(budget: tuple[str, float, float] | None) -> dict[str, str]:
    """The tightest budget after an admission: its name, what it has left (tokens, or
    micro-units of money), and when its window resets (RFC 3339; none for a lifetime budget)."""
    if budget is None:
        return {}
    name, left, until = budget
    headers = {"x-tokenpools-budget": name, "x-tokenpools-budget-remaining": str(int(left))}
    if math.isfinite(until):
        reset = datetime.fromtimestamp(until, UTC).isoformat().replace("+00:00", "Z")
        headers["x-tokenpools-budget-reset"] = reset
    return headers


def charged_headers(entitlements: Mapping[str, EntitlementView], name: str) -> dict[str, str]:
    """What an admitted request is charged to: the entitlement (one of its tenant's layers)."""
    view = entitlements.get(name)
    return {
        ENTITLEMENT_HEADER: _header_value(name),
        CLASS_HEADER: "" if view is None else view.ent.service_class.value,
    }


@functools.lru_cache(maxsize=4096)
def _header_value(name: str) -> str:  # once per entitlement name, not once per request
    return quote(name, safe="/:@._-")
