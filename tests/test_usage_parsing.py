"""How the gateway reads an engine's usage from a whole response without parsing it."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tokenpools.model.request import Usage
from tokenpools.openai_api.usage import usage_in


def test_the_top_level_usage_wins_over_text_that_looks_like_it() -> None:
    content = 'I will say "prompt_tokens": 999 and "completion_tokens": 999 here'
    usage = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    reply = {"choices": [{"message": {"content": content}}], "usage": usage}
    assert usage_in(json.dumps(reply).encode()) == Usage(12, 5)
    spaced = json.dumps(reply, indent=4).encode()
    assert usage_in(spaced) == Usage(12, 5)


def test_responses_and_embeddings_naming() -> None:
    responses = {"output": [], "usage": {"input_tokens": 7, "input_tokens_details": {},
                                         "output_tokens": 3, "total_tokens": 10}}  # fmt: skip
    assert usage_in(json.dumps(responses).encode()) == Usage(7, 3)
    big = {"data": [{"embedding": [0.1] * 5000}], "usage": {"prompt_tokens": 4, "total_tokens": 4}}
    assert usage_in(json.dumps(big).encode()) == Usage(4, 0)
    assert usage_in(b'{"choices": []}') is None


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.text(max_size=300))
def test_any_content_before_the_usage(prompt: int, completion: int, text: str) -> None:
    reply = {"choices": [{"text": text}], "usage": {"prompt_tokens": prompt,
                                                     "completion_tokens": completion}}  # fmt: skip
    assert usage_in(json.dumps(reply, ensure_ascii=False).encode()) == Usage(prompt, completion)
