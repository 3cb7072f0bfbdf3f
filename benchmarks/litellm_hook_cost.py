"""The LiteLLM integration's own CPU per request, measured inside LiteLLM's interpreter without
LiteLLM's server around it: custom auth, the pre-call hook (prompt count, admission) and the
success hook (settlement), each request in a task of its own as LiteLLM runs it. Prints JSON
(and writes it to `--json`).

    .venv-litellm/bin/python benchmarks/litellm_hook_cost.py CONFIG MODEL KEY [--requests N]
    .venv-litellm/bin/python benchmarks/litellm_hook_cost.py --json /tmp/hook.json --smoke

benchmarks/vs_litellm.py runs it with its own config. Without CONFIG MODEL KEY it writes one:
benchmarks/gateway.py's `bench_config` without backends (LiteLLM routes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import litellm
import yaml

from gateway import KEY, MODEL, bench_config
from smoke import parse_args

# The JSON (paths as in benchmarks/smoke.py): the median µs per request, and each run's.
FIELDS = ("us_per_request", "runs_us")
SMOKE = {"requests": 50, "repeats": 1}


async def measure(
    config: Path, model: str, key: str, requests: int, repeats: int = 5
) -> dict[str, float]:
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
    for _ in range(repeats):
        started = time.process_time()
        for i in range(requests):
            await asyncio.create_task(one(i))
        runs.append((time.process_time() - started) / requests * 1e6)
    assert not hook.tracked, "a lease was left held"
    await hook.aclose()
    return {"us_per_request": statistics.median(runs), "runs_us": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, nargs="?")
    parser.add_argument("model", nargs="?", default=MODEL)
    parser.add_argument("key", nargs="?", default=KEY)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parse_args(parser, SMOKE)
    with tempfile.TemporaryDirectory() as tmp:
        config = args.config
        if config is None:  # the benchmark's own: one pool too large to refuse, one key
            own = bench_config("http://127.0.0.1:9")
            for pool in own["pools"]:
                pool.pop("backends")
            config = Path(tmp) / "hook.yaml"
            config.write_text(yaml.safe_dump(own))
        result = asyncio.run(measure(config, args.model, args.key, args.requests, args.repeats))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
