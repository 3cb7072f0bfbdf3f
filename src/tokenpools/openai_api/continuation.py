"""One answer from several engine requests: a suspended chat or completions request resumes
as a continuation whose prompt is the original and the text so far, and the client sees one
answer — a stream that paused, or one whole answer (docs/decisions.md, "Lending, and taking
back"). Pure: the host feeds the engine's stream events in and sends what comes out.

- `suspendable`: which requests can be resumed from their text (one sequence; no tool calls,
  whose arguments are not plain text to continue; no log probabilities, which a continuation
  would report for its own tokens only).
- `segment_body`: what each engine request asks for. The engine always streams (the text so
  far must be known when a request is suspended), with its usage chunk; a continuation's body
  carries the text so far (completions: appended to the prompt; chat: as a final assistant
  message continued, vLLM's `continue_final_message` with `add_generation_prompt: false`)
  and asks for the output tokens left.
- `Transcript`: what the client has received, read from the engine's events as they pass;
  each event comes out rewritten as part of the first request's answer (its id and creation
  time; a continuation's opening role chunk and its usage chunk dropped), and the answer's
  usage counts the original prompt once and every output token once.
"""

from __future__ import annotations

import json
from typing import Any

from tokenpools.openai_api import CHAT, COMPLETIONS, ceiling_field

# What a continuation cannot carry on: several sequences, tool calls, log probabilities.
_NOT_SUSPENDABLE = ("tools", "functions", "logprobs", "top_logprobs", "best_of", "echo", "suffix")


def suspendable(path: str, body: dict[str, Any], chat_continuation: bool = True) -> bool:
    """Whether the request can be suspended and resumed from its text (`chat_continuation`:
    the engine continues a chat's final assistant message)."""
    if path not in (CHAT, COMPLETIONS) or (path == CHAT and not chat_continuation):
        return False
    if body.get("n", 1) != 1 or any(body.get(key) for key in _NOT_SUSPENDABLE):
        return False
    return path == CHAT or isinstance(body.get("prompt"), str)


def segment_body(path: str, body: dict[str, Any], so_far: Transcript | None) -> dict[str, Any]:
    """The engine request of the next segment: the client's body (as the front door cleared
    it), streamed with usage, continuing `so_far` if anything was received."""
    out = dict(body)
    out["stream"] = True
    out["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if so_far is None or not so_far.text:
        return out
    if path == COMPLETIONS:
        out["prompt"] = body["prompt"] + so_far.text
    else:
        out["messages"] = [*body["messages"], {"role": "assistant", "content": so_far.text}]
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    field = ceiling_field(body, path)
    if field is not None:  # lowered in the field the engine reads the ceiling from
        out[field] = max(1, int(body[field]) - so_far.tokens)
    return out


class Transcript:
    """What the client of one suspendable request has received, over all its segments."""

    def __init__(self, path: str, prompt_tokens: int, client_wants_usage: bool) -> None:
        self.path = path
        self.prompt_tokens = prompt_tokens  # the original prompt, counted once
        self.client_wants_usage = client_wants_usage
        self.text = ""  # the answer's text so far
        self.tokens = 0  # output tokens so far: the engines' counts, else one per content event
        self.segments = 0  # engine requests so far
        self.finish_reason: str | None = None
        self.recomputed = 0  # prompt tokens the continuations' engines prefilled again
        self._identity: dict[str, Any] = {}  # id, created, model of the first request's answer
        self._segment_tokens = 0  # content events of the segment under way
        self._segment_usage: dict[str, Any] | None = None

    def begin(self) -> None:
        """A segment's engine request starts (the first, or a continuation)."""
        self.segments += 1
        self._segment_tokens = 0
        self._segment_usage = None

    def suspended(self) -> None:
        """The segment under way was cut off: its content events are its output."""
        self.tokens += self._segment_tokens
        self._segment_tokens = 0

    def read(self, data: bytes) -> bytes | None:
        """One event's data from the engine; returns the data to send the client (None: drop
        it). A segment's usage chunk ends it; the last segment's is rewritten as the answer's
        (sent where the client asked for usage, and kept for settlement either way)."""
        if data == b"[DONE]":
            return data
        try:
            chunk = json.loads(data)
        except ValueError:
            return data
        if not isinstance(chunk, dict):
            return data
        if chunk.get("usage"):  # the segment's end (llama.cpp puts it on the last choice)
            self._end_segment(chunk["usage"])
            if not chunk.get("choices") and not self.client_wants_usage:
                return None
            if self.client_wants_usage:
                chunk["usage"] = self.usage()
            else:
                del chunk["usage"]
            if not chunk.get("choices"):
                return self._as_answer(chunk)
        choices = chunk.get("choices") or []
        if not choices:
            return self._as_answer(chunk)
        choice = choices[0]
        piece = _piece(self.path, choice)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        if piece:
            self.text += piece
            self._segment_tokens += 1
        elif self.segments > 1 and not choice.get("finish_reason"):
            return None  # a continuation's opening role chunk: the client has had one
        return self._as_answer(chunk)

    def _end_segment(self, usage: Any) -> None:
        """The engine's counts for the segment. Its prompt is the original and the output
        before it: less that output, the original prompt as the engine counts it."""
        before = self.tokens
        counted = usage.get("completion_tokens") if isinstance(usage, dict) else None
        self.tokens += counted if isinstance(counted, int) else self._segment_tokens
        self._segment_tokens = 0
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if not isinstance(prompt, int):
            return
        self.prompt_tokens = max(1, prompt - before)
        if self.segments > 1:
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
            if isinstance(cached, int):
                self.recomputed += max(0, prompt - cached)

    def usage(self) -> dict[str, int]:
        """The answer's usage: the original prompt once, every output token once."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens,
        }

    def whole(self) -> dict[str, Any]:
        """The answer as one response, for a client that did not stream."""
        choice: dict[str, Any]
        if self.path == CHAT:
            message = {"role": "assistant", "content": self.text}
            choice = {"index": 0, "message": message, "finish_reason": self.finish_reason}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": self.finish_reason}
            kind = "text_completion"
        return {**self._identity, "object": kind, "choices": [choice], "usage": self.usage()}

    def _as_answer(self, chunk: dict[str, Any]) -> bytes:
        if not self._identity:
            self._identity = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        chunk.update(self._identity)
        return json.dumps(chunk, separators=(",", ":")).encode()


def _piece(path: str, choice: dict[str, Any]) -> str:
    if path == CHAT:
        delta = choice.get("delta") or {}
        content = delta.get("content") if isinstance(delta, dict) else None
    else:
        content = choice.get("text")
    return content if isinstance(content, str) else ""
