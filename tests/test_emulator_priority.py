"""`tokenpools emulate --scheduling-policy`: a chat or completions body's `priority` reaches the
engine on a priority emulator; a fcfs one answers a non-zero priority with vLLM's 400, and any
emulator answers a priority that is not an integer with a 400."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway_setup import FAST
from tests.servers import ServerThread
from tokenpools.emulator.app import make_app
from tokenpools.emulator.server import EMULATOR
from tokenpools.engine.queues import SchedulingPolicy
from tokenpools.openai_api import CHAT, COMPLETIONS

PATHS = [CHAT, COMPLETIONS]


class Emulator:
    def __init__(self, policy: SchedulingPolicy) -> None:
        self.server = ServerThread(make_app(FAST, speed=0, scheduling_policy=policy))
        self.http = httpx.Client(base_url=self.server.url, timeout=10)
        self.priorities: list[int] = []  # what the engine was handed
        emulated = self.server.app[EMULATOR]
        add = emulated.engine.add

        def spy(*args: Any, priority: int = 0, **kwargs: Any) -> None:
            self.priorities.append(priority)
            add(*args, priority=priority, **kwargs)

        self.server.call(lambda: setattr(emulated.engine, "add", spy))

    def post(self, path: str, **extra: Any) -> httpx.Response:
        if path == CHAT:
            body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        else:
            body = {"prompt": "hi"}
        return self.http.post(path, json={"model": "m", "max_tokens": 2, **body, **extra})

    def close(self) -> None:
        self.http.close()
        self.server.stop()


@pytest.fixture(params=["fcfs", "priority"])
def emulator(request: pytest.FixtureRequest) -> Iterator[Emulator]:
    emu = Emulator(request.param)
    yield emu
    emu.close()


@pytest.fixture
def fcfs() -> Iterator[Emulator]:
    emu = Emulator("fcfs")
    yield emu
    emu.close()


@pytest.fixture
def ranked() -> Iterator[Emulator]:
    emu = Emulator("priority")
    yield emu
    emu.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_priority_emulator_hands_the_bodys_priority_to_the_engine(
    ranked: Emulator, path: str
) -> None:
    assert ranked.post(path, priority=-3).status_code == 200
    assert ranked.post(path, priority=7).status_code == 200
    assert ranked.post(path).status_code == 200
    assert ranked.priorities == [-3, 7, 0]


@pytest.mark.parametrize("path", PATHS)
def test_a_fcfs_emulator_refuses_a_priority_as_vllm_words_it(fcfs: Emulator, path: str) -> None:
    refused = fcfs.post(path, priority=5)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["message"] == "Got priority 5 but Priority scheduling is not enabled."
    assert error["param"] == "priority"
    assert fcfs.post(path, priority=0).status_code == 200
    assert fcfs.priorities == [0]  # the refused request never reached the engine


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", ["high", 1.5, True, None, [1]])
def test_a_priority_that_is_not_an_integer_is_a_400(
    emulator: Emulator, path: str, value: object
) -> None:
    refused = emulator.post(path, priority=value)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "priority" and "must be an integer" in error["message"]
    assert emulator.priorities == []
