"""A request's output ceiling is read from the fields its API's engine reads (vLLM's): a field
of another API sets no ceiling, since the engine ignores it. Read from any, a chat request
with only `max_output_tokens: 1` would be reserved one token and generate without limit."""

from __future__ import annotations

from typing import Any

import pytest

from tokenpools.admission.clearing import demand
from tokenpools.openai_api import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, max_tokens

FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
READ = {
    CHAT: ("max_completion_tokens", "max_tokens"),
    COMPLETIONS: ("max_tokens",),
    RESPONSES: ("max_output_tokens",),
}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("field", FIELDS)
def test_a_ceiling_counts_only_in_a_field_the_paths_engine_reads(path: str, field: str) -> None:
    body: dict[str, Any] = {"model": "m", field: 5}
    expected = 5 if field in READ[path] else None
    assert max_tokens(body, path) == expected
    assert demand(path, body, 8).max_tokens == expected


def test_chat_prefers_max_completion_tokens_as_the_engine_does() -> None:
    body = {"model": "m", "max_tokens": 9, "max_completion_tokens": 3}
    assert max_tokens(body, CHAT) == 3


def test_embeddings_generate_nothing_whatever_they_say() -> None:
    assert demand(EMBEDDINGS, {"model": "m", "max_tokens": 7}, 8).max_tokens == 0
