"""What a request's prompt is made of, and the estimate of its tokens when no tokenizer is asked
for. Everything the engine reads counts: every message part, tool calls and their results,
tool definitions, a Responses request's instructions and input items, an embedding's inputs.
Prompts given as token ids count exactly."""

from __future__ import annotations

import json
import random
from typing import Any, NamedTuple

# Chat templates wrap every message in a few tokens of their own (role markers, separators).
FRAMING_TOKENS = 4


class PromptParts(NamedTuple):
    texts: list[str]
    token_ids: int  # tokens given as ids, counted as they are
    messages: int  # chat messages or input items: the template frames each one


def prompt_parts(body: dict[str, Any]) -> PromptParts:
    """What the prompt is made of."""
    texts: list[str] = []
    items = prompt_items(body)
    for message in items:
        _texts_of(message, texts)
    if isinstance(body.get("instructions"), str):
        texts.append(body["instructions"])
    if isinstance(body.get("tools"), list) and body["tools"]:
        texts.append(json.dumps(body["tools"], separators=(",", ":")))
    ids = _plain(body.get("prompt"), texts)
    if not _has_items(body):  # an embedding's input, or a Responses request's plain text
        ids += _plain(body.get("input"), texts)
    return PromptParts(texts, ids, len(items))


def estimate_prompt_tokens(body: dict[str, Any], chars_per_token: float) -> int:
    """Without a tokenizer: ASCII text at `chars_per_token`, other characters (CJK, accents,
    emoji) about one token each, plus chat framing per message. Settlement corrects the
    estimate with the backend's real usage."""
    parts = prompt_parts(body)
    tokens = 0.0
    for text in parts.texts:
        if text.isascii():
            tokens += len(text) / chars_per_token
        else:  # a CJK character is 3 bytes of UTF-8 and about a token
            extra = len(text.encode("utf-8", "surrogatepass")) - len(text)
            wide = extra / 2
            tokens += (len(text) - wide) / chars_per_token + wide
    return max(1, round(tokens) + parts.token_ids + FRAMING_TOKENS * parts.messages)


def prompt_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages, or a Responses request's input items."""
    if isinstance(body.get("messages"), list):
        return [m for m in body["messages"] if isinstance(m, dict)]
    if _has_items(body):
        return [m for m in body["input"] if isinstance(m, dict)]
    return []


def _has_items(body: dict[str, Any]) -> bool:
    value = body.get("input")
    return isinstance(value, list) and any(isinstance(m, dict) for m in value)


def _texts_of(item: dict[str, Any], out: list[str]) -> None:
    """The text a message or input item carries: its content (a string or parts), a tool
    call's name and arguments, a tool result's output."""
    content = item.get("content")
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                for key in ("text", "refusal"):
                    if isinstance(part.get(key), str):
                        out.append(part[key])
            elif isinstance(part, str):
                out.append(part)
    for key in ("name", "arguments", "output"):
        if isinstance(item.get(key), str):
            out.append(item[key])
    calls = item.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            named = (function.get("name"), function.get("arguments"))
            out += [v for v in named if isinstance(v, str)]


def _plain(value: Any, out: list[str]) -> int:
    """A completion prompt or an embedding input: text, texts, token ids, or lists of ids."""
    if isinstance(value, str):
        out.append(value)
        return 0
    if not isinstance(value, list):
        return 0
    ids = 0
    for item in value:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, int):
            ids += 1
        elif isinstance(item, list):
            ids += sum(1 for x in item if isinstance(x, int))
    return ids


# Common short words: a synthetic prompt of about n tokens (the load generator, the real-engine
# checks) at about one token per word.
WORDS = [
    "the",
    "and",
    "for",
    "you",
    "not",
    "are",
    "but",
    "all",
    "any",
    "can",
    "had",
    "her",
    "was",
    "one",
    "our",
    "out",
    "day",
    "get",
    "has",
    "him",
    "his",
    "how",
    "man",
    "new",
    "now",
    "old",
    "see",
    "two",
    "way",
    "who",
    "boy",
    "did",
    "its",
    "let",
    "put",
    "say",
    "she",
    "too",
    "use",
]


def prompt_text(tokens: int, seed: str) -> str:
    """About `tokens` tokens of words drawn from `seed` (the request id): prompts share no
    prefix, so a real engine's prompt cache cannot hide the prefill."""
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=max(1, tokens - FRAMING_TOKENS)))
