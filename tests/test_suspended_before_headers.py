"""A stream taken back before its engine answered at all (no response headers yet, so nothing
was sent to its client): suspended, then resumed into one answer, and charged its prompt once
like any other request. The backend here holds its response headers until the test lets them
go, so the eviction lands in that gap every time."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
from aiohttp import web

from tests.gateway_setup import KEYS, MODEL, admin, config_data, wait_all_ended
from tests.servers import ServerThread, wait_for
from tests.test_gateway_suspension import charged_once, metric
from tokenpools.gateway.app import Gateway, make_app
from tokenpools.model.config import parse_config
from tokenpools.openai_api import CHAT

HELD = web.AppKey("held", dict)


def held_backend() -> web.Application:
    """A chat backend that answers `max_tokens` tokens, streamed, with usage; while
    `state["hold"]` is set, a request waits for `state["go"]` before its response headers."""
    app = web.Application()
    app[HELD] = {"hold": False, "go": asyncio.Event(), "waiting": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        state = request.app[HELD]
        body = await request.json()
        if state["hold"]:
            state["waiting"] += 1
            await state["go"].wait()
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        prompt = sum(len(str(m.get("content", ""))) for m in body["messages"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(data: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")

        chunk = {"id": "held-1", "object": "chat.completion.chunk", "model": body["model"]}
        for _ in range(n):
            await send(chunk | {"choices": [{"index": 0, "delta": {"content": "tok "}}]})
            await asyncio.sleep(0.005)
        await send(chunk | {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
            await send(chunk | {"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app.router.add_post(CHAT, chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", health)
    return app


def stream(server: ServerThread, out: list[str]) -> threading.Thread:
    """A batch stream read in a thread: its content, appended to `out` when it ends."""

    def read() -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 20,
                "messages": [{"role": "user", "content": "go"}],
                "stream_options": {"include_usage": True}}  # fmt: skip
        text = ""
        with (
            httpx.Client(timeout=60) as http,
            http.stream(
                "POST",
                server.url + CHAT,
                json=body,
                headers={"Authorization": f"Bearer {KEYS['batch']}"},
            ) as r,  # fmt: skip
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices") or []:
                        text += (choice.get("delta") or {}).get("content") or ""
        out.append(text)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_stream_taken_back_before_its_engine_answered_is_charged_its_prompt_once() -> None:
    backend = ServerThread(held_backend())
    data = config_data(backend.url)
    data["budgets"] = [
        {"name": f"b-{measure}", "tenant": "b", "limit": 10**9, "measure": measure}
        for measure in ("input", "output")
    ]
    server = ServerThread(make_app(Gateway(parse_config(data))))
    state = backend.app[HELD]

    def counted() -> dict[str, float]:
        return {b["measure"]: b["used"] + b["held"] for b in admin(server, "budgets")["budgets"]}

    try:
        texts: list[str] = []
        stream(server, texts).join(30)  # alone: what one request is charged
        wait_all_ended(server)
        one = wait_for(counted, lambda c: c["output"] == 20, what="one request charged")
        backend.call(lambda: state.update(hold=True))
        readers = [stream(server, texts) for _ in range(8)]  # the pool's 8 slots, all held
        wait_for(lambda: backend.call(lambda: state["waiting"]), lambda n: n == 8,
                 what="eight requests held before their headers")  # fmt: skip
        gold: list[int] = []
        asker = threading.Thread(
            target=lambda: gold.append(
                httpx.post(
                    server.url + CHAT,
                    timeout=60,
                    json={
                        "model": MODEL,
                        "max_tokens": 5,
                        "messages": [{"role": "user", "content": "x"}],
                    },
                    headers={"Authorization": f"Bearer {KEYS['gold']}"},
                ).status_code
            ),
            daemon=True,
        )
        asker.start()

        def evicted() -> float:
            return metric(httpx.get(f"{server.url}/metrics").text, "tokenpools_evicted_total",
                          "batch")  # fmt: skip

        wait_for(evicted, lambda n: n == 1, what="the newest batch stream taken back")
        backend.call(lambda: (state.update(hold=False), state["go"].set()))
        asker.join(30)
        for reader in readers:
            reader.join(30)
        assert gold == [200]
        assert texts == ["tok " * 20] * 9  # every stream whole, the suspended one too
        charged_once(server, counted, one, requests=9, output=20)  # the suspended one's too
    finally:
        server.stop()
        backend.stop()
