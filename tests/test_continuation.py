"""One answer from several engine requests (openai_api/continuation.py), on the shapes engines
send: which requests can be resumed, what each segment asks for, and the events as the client
gets them — one id, one role chunk, usage counting the original prompt once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenpools.openai_api import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from tokenpools.openai_api.continuation import Transcript, segment_body, suspendable

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


@pytest.mark.parametrize(
    ("path", "body", "chat_continuation", "expected"),
    [
        (CHAT, CHAT_BODY, True, True),
        (CHAT, CHAT_BODY, False, False),  # an engine that closes the final assistant message
        (COMPLETIONS, {"prompt": "once"}, False, True),
        (COMPLETIONS, {"prompt": ["a", "b"]}, True, False),  # several prompts
        (COMPLETIONS, {"prompt": [1, 2, 3]}, True, False),  # token ids
        (CHAT, {**CHAT_BODY, "n": 2}, True, False),
        (CHAT, {**CHAT_BODY, "tools": [{"type": "function"}]}, True, False),
        (CHAT, {**CHAT_BODY, "logprobs": True}, True, False),
        (EMBEDDINGS, {"input": "x"}, True, False),
        (RESPONSES, {"input": "x"}, True, False),
    ],
)
def test_which_requests_can_be_resumed_from_their_text(
    path: str, body: dict[str, Any], chat_continuation: bool, expected: bool
) -> None:
    assert suspendable(path, body, chat_continuation) is expected


def _transcript_after(path: str, pieces: list[str]) -> Transcript:
    """A transcript suspended after `pieces`, one content event each."""
    t = Transcript(path, 5, client_wants_usage=False)
    t.begin()
    for piece in pieces:
        choice = {"index": 0, "delta": {"content": piece}} if path == CHAT else {"text": piece}
        t.read(json.dumps({"id": "x", "choices": [choice]}).encode())
    t.suspended()  # cut off there
    return t


def test_the_first_segment_streams_with_usage_and_a_continuation_carries_the_text() -> None:
    first = segment_body(CHAT, CHAT_BODY, None)
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert "continue_final_message" not in first
    so_far = _transcript_after(CHAT, ["Hello", " ", "the"])
    chat = segment_body(CHAT, CHAT_BODY, so_far)
    assert chat["messages"][-1] == {"role": "assistant", "content": "Hello the"}
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    assert chat["max_tokens"] == 7
    upon = _transcript_after(COMPLETIONS, [" upon"])
    text = segment_body(COMPLETIONS, {"prompt": "Once", "max_tokens": 10}, upon)
    assert text["prompt"] == "Once upon" and text["max_tokens"] == 9
    chat = segment_body(CHAT, {**CHAT_BODY, "max_completion_tokens": 10}, so_far)
    assert chat["max_completion_tokens"] == 7
    # a field of another API is ignored by the engine, and by the continuation
    text = segment_body(COMPLETIONS, {"prompt": "Once", "max_tokens": 10,
                                      "max_completion_tokens": 50}, upon)  # fmt: skip
    assert (text["max_tokens"], text["max_completion_tokens"]) == (9, 50)
    assert CHAT_BODY["messages"] == [{"role": "user", "content": "hi"}]  # not written to


def chunk(cid: str, content: str | None, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return json.dumps({"id": cid, "created": 1, "model": "m", "choices": [choice]}).encode()


def usage(prompt: int, completion: int, cached: int = 0) -> bytes:
    counts = {"prompt_tokens": prompt, "completion_tokens": completion,
              "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    return json.dumps({"id": "x", "choices": [], "usage": counts}).encode()


@pytest.mark.parametrize("wants_usage", [True, False])
def test_two_segments_read_as_one_stream(wants_usage: bool) -> None:
    t = Transcript(CHAT, prompt_tokens=99, client_wants_usage=wants_usage)
    sent: list[dict[str, Any]] = []

    def feed(data: bytes) -> None:
        out = t.read(data)
        if out is not None:
            sent.append(json.loads(out))

    t.begin()
    for data in (chunk("a", "", role=True), chunk("a", "Hel"), chunk("a", "lo")):
        feed(data)
    t.suspended()  # cut off: no usage chunk
    assert (t.text, t.tokens) == ("Hello", 2)
    t.begin()
    for data in (chunk("b", "", role=True), chunk("b", " world"), chunk("b", "", finish="length")):
        feed(data)
    feed(usage(prompt=7 + 2, completion=1, cached=8))
    assert t.text == "Hello world" and t.tokens == 3
    assert {c["id"] for c in sent} == {"a"}  # the first request's id throughout
    roles = [c for c in sent if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert len(roles) == 1  # the continuation's opening role chunk dropped
    usages = [c["usage"] for c in sent if "usage" in c]
    # the original prompt as the engine counts it (the continuation's, less the text before)
    expected = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert usages == ([expected] if wants_usage else [])
    assert t.recomputed == 1  # the continuation's prompt less what the engine had cached
    whole = t.whole()
    assert whole["object"] == "chat.completion" and whole["id"] == "a"
    assert whole["choices"][0]["message"]["content"] == "Hello world"
    assert whole["choices"][0]["finish_reason"] == "length"


def test_usage_on_the_last_choice_chunk_ends_the_segment_too() -> None:
    """llama.cpp sends the usage on the chunk that carries the finish reason."""
    t = Transcript(COMPLETIONS, prompt_tokens=3, client_wants_usage=False)
    t.begin()
    t.read(json.dumps({"id": "c", "choices": [{"index": 0, "text": "a"}]}).encode())
    last = {"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1}}  # fmt: skip
    out = t.read(json.dumps(last).encode())
    assert out is not None and "usage" not in json.loads(out)  # the client did not ask
    assert t.tokens == 1 and t.prompt_tokens == 4
