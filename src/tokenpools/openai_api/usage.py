"""Reading an engine's usage from what it answers: a whole response (its tail scanned, not
parsed), a usage object in either naming, a JSON object from an event's data. No HTTP library:
the gateway and the LiteLLM integration both read usage with it."""

from __future__ import annotations

import json
import re
from typing import Any

from tokenpools.model.request import Usage

RESPONSE_END_TYPES = ("response.completed", "response.incomplete", "response.failed")
RESPONSE_ENDS = tuple(f'"{t}"'.encode() for t in RESPONSE_END_TYPES)


# A key can only appear as a key: quotes inside JSON strings are escaped. The last match is the
# top-level usage, which engines write after the output.
_PROMPT = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def usage_in(text: bytes) -> Usage | None:
    prompts = _PROMPT.findall(text, max(0, len(text) - 4096))  # usage sits at the end
    if not prompts:
        prompts = _PROMPT.findall(text)
        if not prompts:
            return None
    completions = _COMPLETION.findall(text, max(0, len(text) - 4096)) or _COMPLETION.findall(text)
    prompt = int(prompts[-1])
    cached = _CACHED.findall(text, max(0, len(text) - 4096))
    return Usage(
        prompt,
        int(completions[-1]) if completions else 0,
        min(prompt, int(cached[-1])) if cached else 0,
    )


def usage_from(usage: Any) -> Usage | None:
    """The engine's counts from a usage object, in the Chat/Completions or Responses naming
    (embeddings report prompt tokens only)."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if isinstance(prompt, int) and isinstance(completion, int) and prompt >= 0 <= completion:
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        ok = isinstance(cached, int) and 0 <= cached <= prompt
        return Usage(prompt, completion, cached if ok else 0)  # type: ignore[arg-type]
    return None


def json_object(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
