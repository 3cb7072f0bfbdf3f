"""The pieces of the OpenAI HTTP API that the gateway and the emulator both speak."""

from __future__ import annotations

import json
import re
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
GENERATES = (CHAT, COMPLETIONS, RESPONSES)  # what may stream and has an output ceiling
# Deeper JSON is refused: real requests (tool schemas included) nest a few dozen levels at
# most, and Python's parser would otherwise fail with a RecursionError near a thousand.
MAX_JSON_DEPTH = 64


class BadRequest(ValueError):
    """A request body the API would refuse with 400; the message names the problem."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}
    ).encode()


def parse_body(raw: bytes, path: str) -> dict[str, Any]:
    """Validate what admission needs of a request body; everything else passes through."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # far deeper than the limit
        raise BadRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    # Nesting deeper than the limit needs more brackets than the limit: most bodies skip the walk
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH:
        raise BadRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' is required and must be a string", "model")
    _check_input(body, path)
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of"):
        value = body.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise BadRequest(f"'{name}' must be a positive integer, got {value!r}", name)
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    if body.get("stream") and path == EMBEDDINGS:
        raise BadRequest("embeddings do not stream", "stream")
    if not isinstance(body.get("stream_options") or {}, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return body


def _check_input(body: dict[str, Any], path: str) -> None:
    """The field that carries the prompt, by endpoint."""
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("each message must be an object", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message.get("tool_calls") or [], list):
                raise BadRequest(f"messages[{i}].tool_calls must be an array", "messages")
    elif path == COMPLETIONS:
        if not isinstance(body.get("prompt"), str | list):
            raise BadRequest("'prompt' must be a string or a list", "prompt")
    elif path == EMBEDDINGS:
        value = body.get("input")
        if not isinstance(value, str | list) or value == []:
            raise BadRequest("'input' must be a string or a non-empty list", "input")
    else:  # RESPONSES
        value = body.get("input")
        if not isinstance(value, str | list) or value in ("", []):
            raise BadRequest("'input' must be a non-empty string or list", "input")
        if isinstance(value, list) and not all(isinstance(item, dict) for item in value):
            raise BadRequest("each input item must be an object", "input")


def json_depth(value: Any) -> int:
    """How deeply arrays and objects nest in a parsed JSON value (a scalar: 0), without
    recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def model_card(name: str) -> dict[str, object]:
    """A model as GET /v1/models lists it (whichever host answers: the gateway, ext_proc)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "tokenpools"}


def sequences(body: dict[str, Any], most: int) -> int:
    """How many sequences the request generates (`n`, or `best_of` when larger); a 400 above
    `most`, the gateway's configured maximum."""
    count = max(body.get("n") or 1, body.get("best_of") or 1)
    if count > most:
        param = "n" if (body.get("n") or 1) >= (body.get("best_of") or 1) else "best_of"
        raise BadRequest(
            f"'{param}' asks for {count} sequences; this gateway allows at most {most}", param
        )
    return int(count)


# The fields an engine reads a request's output ceiling from, by API (vLLM's): a field of
# another API is ignored by the engine, so it sets no ceiling (a chat request with only
# `max_output_tokens: 1` would be reserved 1 token and generate without limit).
CEILING_FIELDS: dict[str, tuple[str, ...]] = {
    CHAT: ("max_completion_tokens", "max_tokens"),
    COMPLETIONS: ("max_tokens",),
    RESPONSES: ("max_output_tokens",),
}


def ceiling_field(body: dict[str, Any], path: str) -> str | None:
    """The field the request sets its output ceiling in, of those its API's engine reads."""
    for name in CEILING_FIELDS.get(path, ()):
        if isinstance(body.get(name), int):
            return name
    return None


def max_tokens(body: dict[str, Any], path: str) -> int | None:
    """The output ceiling the request sets, in a field its API's engine reads."""
    name = ceiling_field(body, path)
    return None if name is None else int(body[name])


def max_tokens_field(path: str) -> str:
    """Where the gateway writes the ceiling it reserved when the request set none."""
    return "max_output_tokens" if path == RESPONSES else "max_tokens"


_GAUGE = re.compile(rb"^((?:vllm|llamacpp):[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)
# llama.cpp's server names for what vLLM calls running and waiting (it has no KV gauge)
_LLAMACPP = {
    "llamacpp:requests_processing": "vllm:num_requests_running",
    "llamacpp:requests_deferred": "vllm:num_requests_waiting",
}


def vllm_gauges(text: bytes) -> dict[str, float]:
    """Sum each `vllm:*` sample of a Prometheus page over its label sets (one per model);
    a llama.cpp server's running and waiting counts come under vLLM's names."""
    out: dict[str, float] = {}
    for raw_name, value in _GAUGE.findall(text):
        name = raw_name.decode()
        name = _LLAMACPP.get(name, name)
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out
