"""The LiteLLM integration's own CPU per request, measured inside LiteLLM's interpreter without
LiteLLM's server around it: custom auth, the pre-call hook (prompt count, admission) and the
success hook (settlement), each request in a task of its own as LiteLLM runs it. Prints JSON.

    .venv-litellm/bin/python benchmarks/litellm_hook_cost.py CONFIG MODEL KEY [--requests N]

benchmarks/vs_litellm.py runs it with its own config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import litellm


async def measure(config: Path, model: str, key: str, requests: int) -> dict[str, float]:
    os.environ["TOKENPOOLS_CONFIG"] = str(config)  # read on first use, as inside LiteLLM
    from tokenpools.integrations.litellm import proxy_handler_instance as hook
    from tokenpools.integrations.litellm import user_api_key_auth as auth_of

    response = litellm.ModelResponse(usage=litellm.Usage(prompt_tokens=30, completion_tokens=8))
    messages = [{"role": "user", "content": "hello " * 20}]

    async def one(i: int) -> None:
        auth = await auth_of(None, key)  # type: ignore[arg-type]  # the request is not read
        data = {"model": model, "messages": messages, "max_tokens": 8, "litellm_call_id": f"{i}"}
        data = await hook.async_pre_call_hook(auth, None, data, "acompletion")
        await hook.async_post_call_success_hook(data, auth, response)

    await asyncio.create_task(one(-1))  # starts the runtime (ticks, store)
    runs = []
    for _ in range(5):
        started = time.process_time()
        for i in range(requests):
            await asyncio.create_task(one(i))
        runs.append((time.process_time() - started) / requests * 1e6)
    assert not hook.held, "a lease was left held"
    await hook.aclose()
    return {"us_per_request": statistics.median(runs), "runs_us": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("model")
    parser.add_argument("key")
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.config, args.model, args.key, args.requests))))


if __name__ == "__main__":
    main()
