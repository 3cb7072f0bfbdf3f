"""Continuation on the emulator, as vLLM serves it: a completions prompt with the answer
appended, or a chat request continuing its final assistant message, reuses the KV the earlier
request left in the engine's prefix cache and says so in
`usage.prompt_tokens_details.cached_tokens`; a stream cut off mid-way leaves its KV too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway_setup import FAST
from tests.servers import ServerThread
from tokenpools.emulator.app import make_app
from tokenpools.openai_api import CHAT, COMPLETIONS

PROMPT = "Write a long story about a lighthouse keeper and the sea " * 8


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    server = ServerThread(make_app(FAST, speed=0))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client
    server.stop()


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_completions_prompt_with_its_answer_appended_reuses_the_cache(
    http: httpx.Client,
) -> None:
    first = http.post(COMPLETIONS, json={"model": "m", "prompt": PROMPT, "max_tokens": 40}).json()
    assert cached(first) == 0
    text = first["choices"][0]["text"]
    again = {"model": "m", "prompt": PROMPT + text, "max_tokens": 10}
    second = http.post(COMPLETIONS, json=again).json()
    prompt = second["usage"]["prompt_tokens"]
    assert prompt > first["usage"]["prompt_tokens"] + 30  # the answer is in the prompt now
    # whole 16-token blocks of the first request's prompt and answer, at least one computed
    assert prompt - 16 <= cached(second) < prompt
    other = http.post(COMPLETIONS, json={"model": "m", "prompt": "unrelated", "max_tokens": 2})
    assert cached(other.json()) == 0


def test_a_chat_answer_continued_as_the_final_assistant_message_reuses_the_cache(
    http: httpx.Client,
) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    first = http.post(CHAT, json={"model": "m", "messages": messages, "max_tokens": 40}).json()
    so_far = first["choices"][0]["message"]["content"]
    body = {
        "model": "m",
        "messages": [*messages, {"role": "assistant", "content": so_far}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 10,
    }
    second = http.post(CHAT, json=body).json()
    assert cached(second) >= second["usage"]["prompt_tokens"] - 20
    assert second["usage"]["completion_tokens"] == 10
    # the same request as a new assistant turn shares only the user message's blocks
    body.pop("continue_final_message"), body.pop("add_generation_prompt")
    third = http.post(CHAT, json=body).json()
    assert cached(third) < cached(second)


def test_a_stream_cut_off_leaves_its_kv_for_the_continuation(http: httpx.Client) -> None:
    received = ""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 5000, "stream": True}
    with http.stream("POST", COMPLETIONS, json=body) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                received += json.loads(line[6:])["choices"][0]["text"]
            if len(received) >= 4 * 50:
                break  # the client goes away: the emulator aborts the request
    again = {"model": "m", "prompt": PROMPT + received, "max_tokens": 5}
    answer = http.post(COMPLETIONS, json=again).json()
    assert cached(answer) >= answer["usage"]["prompt_tokens"] - 17


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"continue_final_message": True}, "add_generation_prompt"),
        ({"continue_final_message": True, "add_generation_prompt": False}, "assistant message"),
    ],
)
def test_continue_final_message_is_refused_as_vllm_refuses_it(
    http: httpx.Client, extra: dict[str, Any], words: str
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    answer = http.post(CHAT, json=body)
    assert answer.status_code == 400
    assert words in answer.json()["error"]["message"]
