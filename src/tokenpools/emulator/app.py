"""The emulator's application: the chat and completions routes (server.py) with the
Responses and embeddings ones (more_apis.py, built on server.py), /v1/models, /health and
/metrics, and the task that steps the engine."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tokenpools.emulator.more_apis import embeddings, responses
from tokenpools.emulator.server import (
    EMULATOR,
    EmulatedEngine,
    chat,
    completions,
    health,
    metrics,
    models,
)
from tokenpools.engine.profile import EngineProfile
from tokenpools.engine.queues import SchedulingPolicy
from tokenpools.openai_api import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES


def make_app(
    profile: EngineProfile, speed: float = 1.0, scheduling_policy: SchedulingPolicy = "fcfs"
) -> web.Application:
    app = web.Application()
    app[EMULATOR] = EmulatedEngine(profile, speed, scheduling_policy)
    app.router.add_post(CHAT, chat)
    app.router.add_post(COMPLETIONS, completions)
    app.router.add_post(RESPONSES, responses)
    app.router.add_post(EMBEDDINGS, embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def start_engine(app: web.Application) -> Any:
        task = asyncio.create_task(app[EMULATOR].run())
        yield
        task.cancel()

    app.cleanup_ctx.append(start_engine)
    return app
