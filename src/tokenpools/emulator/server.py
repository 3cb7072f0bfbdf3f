"""`tokenpools emulate`: the engine model behind an OpenAI-compatible HTTP API, in real time.

One task steps the engine and sleeps each step's duration (divided by `speed`); after each step
every request gets the tokens it generated, streamed as SSE chunks or gathered into one
response. A client that disconnects aborts its request in the engine. /metrics uses vLLM's
names so the gateway's capacity feedback and dashboards read it as they would read vLLM.
Chat and completions bodies may carry vLLM's `priority` (lower is served first), which only an
engine started with `--scheduling-policy priority` accepts other than 0.

Continuation, as vLLM serves it: a chat request with `continue_final_message: true` (and
`add_generation_prompt: false`) continues its final assistant message; a completions prompt
with the output appended continues it by itself. Either reuses the KV its text left behind,
if the engine's prefix cache still holds it (emulator/prefixes.py), and reports the tokens
it reused as `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from tokenpools.emulator.prefixes import Prefixes, answer_opening, prompt_text
from tokenpools.engine.model import Engine
from tokenpools.engine.profile import EngineProfile
from tokenpools.engine.queues import SchedulingPolicy, priority_refusal
from tokenpools.openai_api import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    error_body,
    max_tokens,
    parse_body,
)
from tokenpools.prompt import estimate_prompt_tokens

DEFAULT_MAX_TOKENS = 16
ANSWER_TOKEN = "tok "  # every generated token's text


@dataclass
class _Request:
    req_id: str
    prompt_tokens: int
    sent_at: float
    prefix: str = ""  # the engine's prefix-cache key of what its KV holds
    text: str = ""  # the text its KV holds before its answer (emulator/prefixes.py)
    delivered: int = 0
    cached: int = 0  # prompt tokens served from the prefix cache
    done: bool = False
    updates: asyncio.Queue[int] = field(default_factory=asyncio.Queue)  # tokens, -1 = done


class EmulatedEngine:
    def __init__(
        self,
        profile: EngineProfile,
        speed: float = 1.0,
        scheduling_policy: SchedulingPolicy = "fcfs",
    ) -> None:
        self.engine = Engine(profile, scheduling_policy)
        self.speed = speed
        self.requests: dict[str, _Request] = {}
        self._wake = asyncio.Event()
        self._ids = itertools.count(1)
        self.submitted = 0  # requests received, for tests that check what reached the engine
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Running", labels, registry=self.registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting", labels, registry=self.registry)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV usage", labels, registry=self.registry)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "TTFT",
            labels,
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40),
        )
        self.model = profile.name
        self.prefixes = Prefixes()

    def submit(
        self, prompt_tokens: int, output_tokens: int, priority: int = 0, text: str = ""
    ) -> _Request:
        """`text`: what the request's KV will hold before its answer (its prompt, and a chat
        answer's opening); a request whose text continues an earlier one's shares its KV."""
        self.submitted += 1
        req_id = f"emu-{next(self._ids)}"
        prefix = (self.prefixes.continued(text) if text else "") or req_id
        req = _Request(req_id, prompt_tokens, time.monotonic(), prefix, text)
        self.requests[req.req_id] = req
        self.engine.add(req.req_id, prompt_tokens, output_tokens, priority=priority, prefix=prefix)
        self._wake.set()
        return req

    def abort(self, req: _Request) -> None:
        if not req.done:
            self.engine.abort(req.req_id)
            self.requests.pop(req.req_id, None)
            req.done = True
            self._left(req)

    def _left(self, req: _Request) -> None:
        """Its KV stays cached (the engine's rule): remember the text it holds."""
        if req.text:
            self.prefixes.left(req.prefix, req.text + ANSWER_TOKEN * req.delivered)

    async def run(self) -> None:
        while True:
            if not self.engine.has_work:
                self._publish()
                self._wake.clear()
                await self._wake.wait()
                continue
            result = self.engine.step()
            if self.speed > 0:
                await asyncio.sleep(result.duration_s / self.speed)
            else:
                await asyncio.sleep(0)
            ended = {seq.req_id: seq for seq in result.finished}
            finished = {req_id: seq.generated for req_id, seq in ended.items()}
            for req_id, req in list(self.requests.items()):
                seq = ended.get(req_id) or self.engine.sequence(req_id)
                if seq is not None:
                    req.cached = seq.cached
                total = finished.get(req_id)
                generated = total if total is not None else self.engine.generated(req_id)
                if generated > req.delivered:
                    if req.delivered == 0:
                        self.ttft.labels(self.model).observe(time.monotonic() - req.sent_at)
                    req.updates.put_nowait(generated - req.delivered)
                    req.delivered = generated
                if total is not None:
                    req.done = True
                    req.updates.put_nowait(-1)
                    del self.requests[req_id]
                    self._left(req)
            self._publish()

    def _publish(self) -> None:
        self.running.labels(self.model).set(self.engine.num_running)
        self.waiting.labels(self.model).set(self.engine.scheduled_waiting)
        self.kv.labels(self.model).set(self.engine.kv_usage)


EMULATOR: web.AppKey[EmulatedEngine] = web.AppKey("emulator", EmulatedEngine)


def _chunk(kind: str, rid: str, model: str, text: str, finish: str | None) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


async def read_body(request: web.Request) -> dict[str, Any] | web.Response:
    """The validated body, or the 400 to answer."""
    try:
        return parse_body(await request.read(), request.path)
    except BadRequest as exc:
        return _bad_request(exc)


def read_priority(body: dict[str, Any], policy: SchedulingPolicy) -> int:
    """The body's `priority`, 0 when absent. vLLM's protocol types it `int` (so a string, a
    float or null is a 400) and refuses any but 0 without priority scheduling."""
    value: object = body.get("priority", 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'priority' must be an integer, got {value!r}", "priority")
    if refusal := priority_refusal(policy, value):
        raise BadRequest(refusal, "priority")
    return value


def check_continuation(body: dict[str, Any], kind: str) -> None:
    """A chat request that continues its final assistant message (vLLM's
    `continue_final_message`) is refused as vLLM refuses it: with `add_generation_prompt`, or
    without an assistant message last."""
    if kind != "chat" or not body.get("continue_final_message"):
        return
    if body.get("add_generation_prompt", True):
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    last = body["messages"][-1] if body["messages"] else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise BadRequest(
            "`continue_final_message` needs an assistant message last", "continue_final_message"
        )


def _bad_request(exc: BadRequest) -> web.Response:
    return web.Response(
        status=400,
        body=error_body(str(exc), "invalid_request_error", None, exc.param),
        content_type="application/json",
    )


async def _completion(request: web.Request, kind: str) -> web.StreamResponse:
    emu = request.app[EMULATOR]
    body = await read_body(request)
    if isinstance(body, web.Response):
        return body
    try:
        priority = read_priority(body, emu.engine.scheduling_policy)
    except BadRequest as exc:
        return _bad_request(exc)
    try:
        check_continuation(body, kind)
    except BadRequest as exc:
        return _bad_request(exc)
    prompt = estimate_prompt_tokens(body, 4.0)
    output = max_tokens(body, CHAT if kind == "chat" else COMPLETIONS) or DEFAULT_MAX_TOKENS
    req = emu.submit(prompt, output, priority, prompt_text(body) + answer_opening(body))
    rid = f"cmpl-{req.req_id}"
    model = body["model"]
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": 0,
        "total_tokens": prompt,
    }
    if not body.get("stream"):
        try:
            while (n := await req.updates.get()) >= 0:
                usage["completion_tokens"] += n
        except asyncio.CancelledError:
            emu.abort(req)
            raise
        usage["total_tokens"] = prompt + usage["completion_tokens"]
        usage["prompt_tokens_details"] = {"cached_tokens": req.cached}
        text = ANSWER_TOKEN * usage["completion_tokens"]
        payload = _chunk(kind, rid, model, text, "length")
        if kind == "chat":
            choice = payload["choices"][0]
            choice["message"] = {"role": "assistant", "content": choice.pop("delta")["content"]}
            payload["object"] = "chat.completion"
        payload["usage"] = usage
        return web.json_response(payload)

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    try:
        while (n := await req.updates.get()) >= 0:
            for _ in range(n):
                usage["completion_tokens"] += 1
                data = _chunk(kind, rid, model, ANSWER_TOKEN, None)
                await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        await response.write(
            b"data: " + json.dumps(_chunk(kind, rid, model, "", "length")).encode() + b"\n\n"
        )
        if include_usage:
            usage["total_tokens"] = prompt + usage["completion_tokens"]
            usage["prompt_tokens_details"] = {"cached_tokens": req.cached}
            tail = _chunk(kind, rid, model, "", None) | {"choices": [], "usage": usage}
            await response.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        emu.abort(req)
        raise
    return response


async def chat(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, "text")


async def models(request: web.Request) -> web.Response:
    emu = request.app[EMULATOR]
    return web.json_response({"object": "list", "data": [{"id": emu.model, "object": "model"}]})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def metrics(request: web.Request) -> web.Response:
    emu = request.app[EMULATOR]
    emu._publish()
    return web.Response(body=generate_latest(emu.registry), content_type="text/plain")
