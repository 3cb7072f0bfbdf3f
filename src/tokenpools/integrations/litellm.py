"""tokenpools inside a LiteLLM proxy: every request LiteLLM serves is admitted by the same
decision core, on the same store, as `tokenpools serve` would admit it, and settled on the
usage LiteLLM reads from the engine.

A proxy config names two objects of this module, and the environment names the tokenpools
config (with `state.backend: redis` when LiteLLM runs several workers, so they share one ledger):

    general_settings:
      custom_auth: tokenpools.integrations.litellm.user_api_key_auth
    litellm_settings:
      callbacks: tokenpools.integrations.litellm.proxy_handler_instance
      num_retries: 0

    TOKENPOOLS_CONFIG=/etc/tokenpools/tokenpools.yaml litellm --config litellm.yaml

In a cluster, TOKENPOOLS_KUBERNETES_NAMESPACE (the platform's namespace) reads the TokenPools,
TokenEntitlements and TokenBudgets instead, that file beside them (integrations/config_source.py).

LiteLLM's extension points used, and why each (docs/litellm.md says more):
- custom auth: the bearer key → its tenant, from the keys in the tokenpools config; with
  LiteLLM's own virtual keys instead, a `tokenpools_tenant` in the key's or team's metadata, or
  the key's team (its id or alias), names the tenant (a `tokenpools_entitlement`, or a team
  named as an entitlement, names that one entitlement, as before tenants); the request's
  model then picks the pool and the tenant's entitlements there (its layers);
- `async_pre_call_hook`: admission, before LiteLLM's router, so a refusal is never retried by it;
  a refusal is a ProxyException, which LiteLLM answers with our status and headers;
- `async_post_call_success_hook`: settles a whole response on its usage;
- `async_post_call_streaming_iterator_hook`: wraps a stream; it settles when the stream ends,
  however it ends (the client's disconnect included), and ends a stream evicted by higher-priority
  work with an error event;
- `async_post_call_failure_hook`: releases the lease of a call that failed.
The request's task, seen at admission, is the last guard: if it ends with its lease still held,
because LiteLLM failed somewhere no hook hears, the lease is released."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException, UserAPIKeyAuth

from tokenpools.admission import AdmissionRuntime, Admitted, FrontDoor, Stopped
from tokenpools.admission.budget_notices import BudgetNotices
from tokenpools.admission.jobs import PeriodicJobs
from tokenpools.admission.ledger import Ledger
from tokenpools.control.tenancy import Caller, Refused
from tokenpools.integrations.config_source import Follow, config_source
from tokenpools.model.request import Usage
from tokenpools.openai_api import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
)
from tokenpools.openai_api.refusals import preempted
from tokenpools.openai_api.usage import usage_from

# What a LiteLLM key's or team's metadata may carry (our custom auth writes them for our keys)
TENANT_METADATA = "tokenpools_tenant"
ENTITLEMENT_METADATA = "tokenpools_entitlement"  # a key reaching one entitlement only
MODELS_METADATA = "tokenpools_models"  # a key's model allow-list
CREDENTIAL_METADATA = "tokenpools_key"  # a key's label
# LiteLLM's call types that reach an engine, and the OpenAI endpoint each one is
CALL_PATHS = {
    "completion": CHAT,
    "acompletion": CHAT,
    "text_completion": COMPLETIONS,
    "atext_completion": COMPLETIONS,
    "responses": RESPONSES,
    "aresponses": RESPONSES,
    "embeddings": EMBEDDINGS,
    "aembedding": EMBEDDINGS,
    "anthropic_messages": CHAT,  # /v1/messages: messages and max_tokens, counted as a chat
}
# Calls that reach no engine's generation, let through ungoverned; any other call type is
# refused, so no endpoint LiteLLM adds becomes a way around admission.
UNGOVERNED = frozenset({"moderation", "amoderation", "acount_tokens", "count_tokens"})
TICK_INTERVAL_S = 0.25
WATCH_INTERVAL_S = 2.0


@dataclass
class Tracked:
    """An admitted request while LiteLLM serves it."""

    admitted: Admitted
    prompt_tokens: int
    stream: bool


def _error(status: int, message: str, kind: str, code: str, **headers: str) -> ProxyException:
    return ProxyException(message, kind, None, status, headers=dict(headers), openai_code=code)


def _usage(obj: Any) -> Usage | None:
    usage = getattr(obj, "usage", None)
    if usage is not None and hasattr(usage, "model_dump"):
        usage = usage.model_dump()
    return usage_from(usage)


class TokenPoolsHook(CustomLogger):  # type: ignore[misc]  # LiteLLM ships no type information
    """The callback LiteLLM calls; the admission runtime (core, store, ticks, lease renewal)
    is built from the tokenpools config on first use, inside LiteLLM's event loop."""

    def __init__(self, config_path: str | Path | None = None) -> None:
        super().__init__()
        self.config_path = config_path
        self._admission: AdmissionRuntime | None = None
        self._door: FrontDoor | None = None
        self._jobs: PeriodicJobs | None = None
        self._ledger: Ledger | None = None
        self._notices: BudgetNotices | None = None
        self._follow: Follow | None = None  # the config's source, followed once started
        self._starting = asyncio.Lock()
        self._following: asyncio.Task[None] | None = None  # the config file, followed
        self.tracked: dict[str, Tracked] = {}  # by LiteLLM's call id
        self.answer_headers: dict[str, dict[str, str]] = {}  # x-ratelimit-*, by call id

    @property
    def admission(self) -> AdmissionRuntime:
        """The runtime, built (not started) on first use: custom auth needs only its keys."""
        if self._admission is None:
            self._build()
        assert self._admission is not None
        return self._admission

    @property
    def door(self) -> FrontDoor:
        """Where requests are admitted: the same front door as every host's."""
        if self._door is None:
            self._build()
        assert self._door is not None
        return self._door

    def _build(self) -> None:
        """The runtime from the config's source, its front door and its services (each on
        its own loop once started)."""
        config, self._follow = config_source(self.config_path, WATCH_INTERVAL_S)
        admission = AdmissionRuntime(config)
        self._jobs, self._ledger = PeriodicJobs(admission), Ledger(admission)
        self._notices = BudgetNotices(admission)
        self._door = FrontDoor(admission)
        self._admission = admission

    async def started(self) -> AdmissionRuntime:
        """The runtime, started in LiteLLM's event loop on the first request: ticks, lease
        renewal, and the config's source followed as `tokenpools serve` follows it."""
        admission = self.admission
        if not admission.running:
            async with self._starting:
                if not admission.running:
                    await admission.start()
                    assert self._jobs is not None and self._ledger and self._notices
                    self._jobs.start(TICK_INTERVAL_S)
                    self._ledger.start()
                    self._notices.start()
                    assert self._follow is not None
                    self._following = asyncio.create_task(self._follow(admission))
        return admission

    async def aclose(self) -> None:
        """Stop the background work and close the store's connections (a host shutting
        down; LiteLLM's own exit does without: leases it held expire in the store)."""
        if self._following is not None:
            self._following.cancel()
        if self._admission is not None and self._admission.running:
            assert self._jobs is not None and self._ledger and self._notices
            await self._jobs.stop()
            await self._notices.stop()
            await self._ledger.stop()
            await self._admission.stop()

    def caller_of(self, auth: UserAPIKeyAuth) -> Caller | None:
        """The tenant a LiteLLM key or team names, or the one entitlement it names (the key's
        metadata first, then the team's, then the team's id and alias); None: nothing known."""
        tenants, entitlements = self.admission.directory.tenants, self.admission.entitlements
        key_meta = auth.metadata or {}
        team_meta = getattr(auth, "team_metadata", None) or {}
        models = key_meta.get(MODELS_METADATA)
        allowed = frozenset(models) if isinstance(models, list) else None
        credential = str(key_meta.get(CREDENTIAL_METADATA) or "litellm")
        named = (
            (key_meta.get(TENANT_METADATA), key_meta.get(ENTITLEMENT_METADATA)),
            (team_meta.get(TENANT_METADATA), team_meta.get(ENTITLEMENT_METADATA)),
            (auth.team_id, auth.team_id),
            (getattr(auth, "team_alias", None), getattr(auth, "team_alias", None)),
        )
        for tenant, entitlement in named:
            if isinstance(tenant, str) and tenant in tenants:
                return Caller(tenant, credential, allowed)
            if isinstance(entitlement, str) and entitlement in entitlements:
                tenant = entitlements[entitlement].ent.tenant_id
                return Caller(tenant, credential, allowed, entitlement)
        return None

    async def async_pre_call_hook(
        self, user_api_key_dict: UserAPIKeyAuth, cache: Any, data: dict[str, Any], call_type: str
    ) -> dict[str, Any]:
        if call_type in UNGOVERNED:
            return data
        path = CALL_PATHS.get(call_type)
        if path is None:
            raise _error(
                403,
                f"tokenpools admits chat, completions, responses, messages and embeddings; "
                f"{call_type} calls are not governed, so they are refused",
                "permission_error",
                "call_type_not_governed",
            )
        await self.started()
        caller = self.caller_of(user_api_key_dict)
        if caller is None:
            raise _error(
                401, "this key maps to no tokenpools tenant", "auth_error", "invalid_api_key"
            )
        stream = bool(data.get("stream"))
        task = asyncio.current_task()
        # a stream is ended by its iterator (an error event), others by cancelling their task
        result = await self.door.enter(None, caller, path, data, task=None if stream else task)
        if isinstance(result, Stopped):
            r = result.refusal
            code = r.code or "invalid_request"  # LiteLLM's error needs one
            # LiteLLM writes the status as the body's `code`: the reason goes in a header too
            reason = {} if result.decision is None else {"x-tokenpools-reason": code}
            raise _error(r.status, r.message, r.kind, code, **r.headers, **reason)
        # a stream's usage chunk was asked for by the front door (LiteLLM needs it)
        decision, prompt_tokens, admitted = result.decision, result.prompt_tokens, result.admitted
        call_id = data.setdefault("litellm_call_id", decision.lease.lease_id)
        self.tracked[call_id] = Tracked(admitted, prompt_tokens, stream)
        self.answer_headers[call_id] = result.headers
        if task is not None:
            task.add_done_callback(lambda _: self._forget(call_id))
        return data

    def _forget(self, call_id: str) -> None:
        """The request's task has ended: nothing of it may stay held."""
        self.answer_headers.pop(call_id, None)
        self._end(call_id, None, refund=False)

    async def async_post_call_response_headers_hook(
        self,
        data: dict[str, Any],
        user_api_key_dict: UserAPIKeyAuth,
        response: Any,
        request_headers: dict[str, str] | None = None,
        litellm_call_info: dict[str, object] | None = None,
    ) -> dict[str, str] | None:
        """The admission's x-ratelimit-* headers on the answer, as the gateway sends them."""
        return self.answer_headers.pop(data.get("litellm_call_id", ""), None)

    def _end(self, call_id: str, usage: Usage | None, refund: bool = True) -> None:
        """Settle on `usage`, or release (refund, or charge the reservation): once per call."""
        tracked = self.tracked.pop(call_id, None)
        if tracked is not None:  # an evicted one has already ended: this does nothing then
            tracked.admitted.end(usage, refund)

    async def async_post_call_success_hook(
        self, data: dict[str, Any], user_api_key_dict: UserAPIKeyAuth, response: Any
    ) -> Any:
        call_id = data.get("litellm_call_id", "")
        tracked = self.tracked.get(call_id)
        if tracked is not None and not tracked.stream:
            self._end(call_id, _usage(response) or Usage(tracked.prompt_tokens, 0))
        return response

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: UserAPIKeyAuth,
        traceback_str: str | None = None,
    ) -> None:
        # the engine may have worked until a timeout: charge it then; refund other failures
        timed_out = (
            isinstance(original_exception, TimeoutError)
            or "Timeout" in type(original_exception).__name__
        )
        self._end(request_data.get("litellm_call_id", ""), None, refund=not timed_out)

    async def async_post_call_streaming_iterator_hook(
        self, user_api_key_dict: UserAPIKeyAuth, response: Any, request_data: dict[str, Any]
    ) -> Any:
        call_id = request_data.get("litellm_call_id", "")
        tracked = self.tracked.get(call_id)
        if tracked is None:
            async for item in response:
                yield item
            return
        usage: Usage | None = None
        streamed = 0
        try:
            async for item in response:
                if tracked.admitted.evicted:
                    why = preempted()
                    raise _error(why.status, why.message, why.kind, "preempted", **why.headers)
                usage = _usage(item) or usage
                streamed += bool(getattr(item, "choices", None))
                yield item
        finally:  # also on the client's disconnect: charge what was streamed
            self._end(call_id, usage or Usage(tracked.prompt_tokens, streamed), refund=False)


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    """LiteLLM's custom auth: a key of the tokenpools config → its tenant, as the team (with the
    key's label, model allow-list and, for a key written on an entitlement, that entitlement
    in the key's metadata)."""
    admission = proxy_handler_instance.admission
    caller = admission.directory.by_key(api_key, admission.clock())
    if caller is None:
        raise _error(401, "invalid API key", "auth_error", "invalid_api_key")
    if isinstance(caller, Refused):
        raise _error(401, caller.message, "auth_error", caller.code)
    metadata: dict[str, Any] = {CREDENTIAL_METADATA: caller.credential}
    if caller.models is not None:
        metadata[MODELS_METADATA] = sorted(caller.models)
    if caller.entitlement is not None:
        metadata[ENTITLEMENT_METADATA] = caller.entitlement
    else:
        metadata[TENANT_METADATA] = caller.tenant
    team = caller.entitlement or caller.tenant
    return UserAPIKeyAuth(api_key=api_key, team_id=team, team_alias=team, metadata=metadata)


proxy_handler_instance = TokenPoolsHook()
