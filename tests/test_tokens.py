"""Prompt-token counting per pool: a tokenizer file, the engine's own /tokenize (vLLM's
dialect here; llama.cpp's in test_real_engine.py), and the estimate as the fallback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.gateway_setup import config_data
from tests.servers import ServerThread
from tokenpools.gateway.backend_tokens import PAUSE_S, BackendTokens, as_messages
from tokenpools.gateway.backends import BackendPool
from tokenpools.gateway.runtime import Gateway
from tokenpools.model.config import ConfigError, parse_config
from tokenpools.model.pool import Backend
from tokenpools.processes import free_port
from tokenpools.prompt import estimate_prompt_tokens
from tokenpools.tokenizing.counter import PromptCounter

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
BODY = {"model": "m", "messages": [{"role": "user", "content": "what is the weather in Paris"}],
        "tools": TOOLS}  # fmt: skip


class VllmTokenize:
    """vLLM's /tokenize: {"count": N} for a chat (template and tools applied) or a prompt."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.asked: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        self.server = ServerThread(app)

    async def tokenize(self, request: web.Request) -> web.Response:
        self.asked.append(await request.json())
        return web.json_response({"count": self.count, "max_model_len": 4096, "tokens": []})


@pytest.fixture
def vllm() -> Iterator[VllmTokenize]:
    server = VllmTokenize(count=321)
    yield server
    server.server.stop()


class PoolCounter:
    """A pool's counter with its engines, as the gateway puts them together."""

    def __init__(self, mode: str, chars_per_token: float, timeout_s: float, **clock: Any) -> None:
        self.counter = PromptCounter(mode, chars_per_token)
        self.engines = BackendTokens(timeout_s, **clock)

    @property
    def fallbacks(self) -> int:
        return self.counter.fallbacks


def count(counter: PoolCounter, body: dict[str, Any], path: str, url: str) -> int:
    async def run() -> int:
        async with aiohttp.ClientSession() as session:
            pool = BackendPool((Backend(url, model="served"),))
            return await counter.counter.count(body, path, counter.engines.asker(pool, session))

    return asyncio.run(run())


def test_backend_mode_asks_the_engine_with_the_template_and_tools(vllm: VllmTokenize) -> None:
    counter = PoolCounter("backend", 4.0, 0.5)
    assert count(counter, BODY, CHAT, vllm.server.url) == 321
    asked = vllm.asked[-1]
    assert asked["model"] == "served" and asked["tools"] == TOOLS
    assert asked["messages"] == BODY["messages"] and asked["add_generation_prompt"] is True
    completion = {"model": "m", "prompt": "once upon a time"}
    assert count(counter, completion, "/v1/completions", vllm.server.url) == 321
    assert vllm.asked[-1]["prompt"] == "once upon a time"
    assert counter.fallbacks == 0


def test_without_an_answer_the_estimate_stands_in() -> None:
    counter = PoolCounter("backend", 4.0, 0.2)
    nobody = f"http://127.0.0.1:{free_port()}"
    assert count(counter, BODY, CHAT, nobody) == estimate_prompt_tokens(BODY, 4.0)
    assert counter.fallbacks == 1


def test_a_backend_that_cannot_count_is_left_alone_for_a_while() -> None:
    asked: list[str] = []

    async def record(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"error": {"message": "not here"}}, status=404)

    app = web.Application()
    app.router.add_post("/{path:.*}", record)
    server = ServerThread(app)
    now = [0.0]
    counter = PoolCounter("backend", 4.0, 0.5, clock=lambda: now[0])
    try:
        estimate = estimate_prompt_tokens(BODY, 4.0)
        assert count(counter, BODY, CHAT, server.url) == estimate
        assert asked == ["/tokenize", "/apply-template"]  # vLLM's way, then llama.cpp's
        assert count(counter, BODY, CHAT, server.url) == estimate
        assert len(asked) == 2 and counter.fallbacks == 2  # paused: not asked again
        now[0] = PAUSE_S + 1
        count(counter, BODY, CHAT, server.url)
        assert len(asked) == 4 and counter.fallbacks == 3
    finally:
        server.stop()


def test_a_tokenizer_file_encodes_every_part(tmp_path: Path) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["what is the weather in Paris", '{"type":"function"}', "天气怎么样"] * 20
    tokenizer.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"])
    )
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    counter = PoolCounter(str(path), 4.0, 0.5)
    texts = ["what is the weather in Paris", json.dumps(TOOLS, separators=(",", ":"))]
    expected = sum(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in texts) + 4
    assert count(counter, BODY, CHAT, "http://unused") == expected
    cjk = {"model": "m", "messages": [{"role": "user", "content": "天气怎么样" * 10}]}
    assert count(counter, cjk, CHAT, "http://unused") == (
        len(tokenizer.encode("天气怎么样" * 10, add_special_tokens=False).ids) + 4
    )


def test_an_unreadable_tokenizer_is_a_config_error_naming_it(tmp_path: Path) -> None:
    data = config_data("http://127.0.0.1:9")
    data["pools"][0]["tokenizer"] = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"missing\.json: no such file"):
        Gateway(parse_config(data))
    (tmp_path / "broken.json").write_text("{not a tokenizer")
    data["pools"][0]["tokenizer"] = str(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="cannot be read"):
        Gateway(parse_config(data))


def test_a_responses_request_is_tokenized_as_chat_messages() -> None:
    parts = [{"type": "input_text", "text": "hi"}]
    body = {"model": "m", "instructions": "be brief", "input": [{"role": "user", "content": parts}]}
    assert as_messages(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert as_messages({"model": "m", "input": "plain"}) == [{"role": "user", "content": "plain"}]
