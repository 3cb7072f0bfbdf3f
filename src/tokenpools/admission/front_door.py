"""The front door every host admits through (`AdmissionRuntime.clear`): a host-neutral request
— who calls, which OpenAI endpoint, the parsed body — in; a `Cleared` request or a `Stopped`
one out. Everything between lives here or below, once: the fields admission reads off the
body, the cost rule per endpoint (embeddings generate nothing), the route to a pool and the
caller's layers there, the prompt count, the admission itself, and writing the `max_tokens`
the reservation assumed back into the body. A host only translates its wire to the request
and the answer back to its wire (the gateway: aiohttp; LiteLLM: its hook; ext_proc: Envoy's
messages). No HTTP library here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenpools.control.catalog import EntitlementView
from tokenpools.control.decisions import Admit, Reject
from tokenpools.control.tenancy import Caller
from tokenpools.openai_api import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    max_tokens,
    max_tokens_field,
    sequences,
)
from tokenpools.openai_api.answer_tap import AnswerTap
from tokenpools.openai_api.refusals import (
    Refusal,
    bad_request,
    budget_headers,
    charged_headers,
    ratelimit_headers,
)


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    """One request as every host hands it in. `body` is the parsed JSON body; a `max_tokens`
    the reservation assumed (the entitlement's default, or one lowered to fit a budget) is
    written into it (`Cleared.rewritten`)."""

    caller: Caller
    path: str  # the OpenAI endpoint (openai_api: CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Cleared:
    """Admitted: the host holds it (`AdmissionRuntime.hold`) and sends it to `pool`."""

    decision: Admit
    pool: str
    prompt_tokens: int  # as admission counted them
    rewritten: bool  # the body was written to (max_tokens, usage asked): forward the body
    headers: dict[str, str]  # x-ratelimit-*, the entitlement charged and its class, the budget
    stream: bool = False
    # the client asked for a stream's usage chunk itself; if not, the front door asked on its
    # behalf and the host keeps that chunk from it (openai_api.answer_tap.AnswerTap)
    usage_asked: bool = False

    def tap(self, path: str) -> AnswerTap:
        """The reader of this request's answer, for the host that relays it."""
        return AnswerTap(path, self.stream, self.usage_asked)


@dataclass(frozen=True, slots=True)
class Stopped:
    """Refused: answer `refusal`. `decision` is None when the request never reached admission
    (a field it cannot read, a model the caller may not use)."""

    refusal: Refusal
    decision: Reject | None = None
    entitlement: str | None = None  # the layer a refusal of admission counts on: the first
    pool: str | None = None
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Asked:
    """What admission reads off a body: the sequences it generates, and the output ceiling it
    sets (None: the entitlement's default; 0 for what generates nothing)."""

    sequences: int
    max_tokens: int | None


def asked(request: AdmissionRequest, most_sequences: int) -> Asked:
    """Raises openai_api.BadRequest naming a field admission cannot take."""
    count = sequences(request.body, most_sequences)
    return Asked(count, 0 if request.path == EMBEDDINGS else max_tokens(request.body))


def no_route(model: object) -> Stopped:
    return Stopped(
        Refusal(
            404,
            f"model {model!r} does not exist or this key has no access to it",
            "invalid_request_error",
            "model_not_found",
            "model",
            {},
        )
    )


def bad_field(message: str, param: str | None) -> Stopped:
    return Stopped(bad_request(message, param))


def write_back(request: AdmissionRequest, decision: Admit, requested: int | None) -> bool:
    """Make the ceiling the reservation assumed true upstream: written where the request set
    none, or where a budget lowered it. Returns whether the body changed."""
    if requested is not None and not decision.lowered:
        return False
    request.body[max_tokens_field(request.path)] = decision.max_tokens
    return True


def usage_asked(body: dict[str, Any]) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def ask_for_usage(request: AdmissionRequest) -> bool:
    """A chat or completions stream always asks the engine for its usage chunk, so it settles
    on the engine's counts; returns whether the body changed."""
    body = request.body
    if not body.get("stream") or request.path not in (CHAT, COMPLETIONS) or usage_asked(body):
        return False
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return True


def cleared_headers(decision: Admit, entitlements: Mapping[str, EntitlementView]) -> dict[str, str]:
    return (
        ratelimit_headers(decision.quota)
        | charged_headers(entitlements, decision.lease.entitlement)
        | budget_headers(decision.budget)
    )
