"""Prompt tokens counted by a pool's engines (`tokenizer: backend`): vLLM's /tokenize, or
llama.cpp's /apply-template then /tokenize (which one a backend speaks is found on first use).
A failure (no healthy backend, a timeout, an engine without the endpoint) pauses that backend
and the estimate stands in (tokenizing/counter.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from tokenpools.gateway.backends import BackendPool, BackendState
from tokenpools.openai_api import CHAT, RESPONSES
from tokenpools.prompt import prompt_items, prompt_parts
from tokenpools.tokenizing.counter import AskBackend

# After a backend fails to count (no endpoint, a timeout), it is not asked again for this long:
# every request would otherwise pay the failed round trips before its estimate.
PAUSE_S = 30.0


class BackendTokens:
    """Counting by a pool's engines: which dialect each backend speaks (found on first use),
    and which backends failed lately (not asked again for PAUSE_S)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.paused: dict[str, float] = {}  # backend URL → when it may be asked again
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.dialects: dict[str, str] = {}  # backend URL → vllm | llamacpp

    def asker(self, pool: BackendPool, session: aiohttp.ClientSession | None) -> AskBackend:
        """How a pool's PromptCounter asks this pool's engines."""

        async def ask(body: dict[str, Any], path: str) -> int | None:
            return await self.count(body, path, pool, session)

        return ask

    async def count(
        self,
        body: dict[str, Any],
        path: str,
        pool: BackendPool,
        session: aiohttp.ClientSession | None,
    ) -> int | None:
        """The engine's count, or None (no session, no healthy backend, a failure)."""
        backend = None if session is None else pool.choose()
        if backend is None or self.paused.get(backend.spec.url, 0.0) > self.clock():
            return None
        assert session is not None
        try:
            return await self._ask(session, backend, body, path)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            self.paused[backend.spec.url] = self.clock() + PAUSE_S
            self.dialects.pop(backend.spec.url, None)  # found again when it answers
            return None

    async def _ask(
        self,
        session: aiohttp.ClientSession,
        backend: BackendState,
        body: dict[str, Any],
        path: str,
    ) -> int:
        url = backend.spec.url
        model = backend.spec.model or body["model"]
        messages = as_messages(body) if path in (CHAT, RESPONSES) else None
        dialect = self.dialects.get(url, "vllm")
        if dialect == "vllm":
            request: dict[str, Any] = {"model": model}
            if messages is not None:
                request |= {"messages": messages, "add_generation_prompt": True}
                if body.get("tools"):
                    request["tools"] = body["tools"]
            else:
                request["prompt"] = _plain_text(body)
            reply = await self._post(session, backend, "/tokenize", request)
            if isinstance(reply.get("count"), int):
                self.dialects[url] = "vllm"
                return int(reply["count"])
            self.dialects[url] = dialect = "llamacpp"  # its /tokenize wants `content`
        text = _plain_text(body)
        if messages is not None:
            template = {"messages": messages} | (
                {"tools": body["tools"]} if body.get("tools") else {}
            )
            text = (await self._post(session, backend, "/apply-template", template))["prompt"]
        reply = await self._post(
            session, backend, "/tokenize", {"content": text, "add_special": True}
        )
        return len(reply["tokens"])

    async def _post(
        self, session: aiohttp.ClientSession, backend: BackendState, path: str, data: Any
    ) -> dict[str, Any]:
        async with session.post(
            backend.spec.url + path,
            data=json.dumps(data),
            headers={"Content-Type": "application/json", **backend.auth},
            timeout=self.timeout,
        ) as r:
            reply = await r.json(content_type=None) if r.status == 200 else {}
        return reply if isinstance(reply, dict) else {}


def as_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages, or a Responses request's instructions and input as messages."""
    if "messages" in body:
        return list(body["messages"])
    out: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        out.append({"role": "system", "content": body["instructions"]})
    if isinstance(body.get("input"), str):
        return [*out, {"role": "user", "content": body["input"]}]
    for item in prompt_items(body):
        content = item.get("content")
        if isinstance(content, list):  # input_text parts → plain text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": item.get("role", "user"), "content": content or ""})
    return out


def _plain_text(body: dict[str, Any]) -> str:
    return "\n".join(prompt_parts(body).texts)
