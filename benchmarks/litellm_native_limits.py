"""LiteLLM's own per-key limits without its database, for benchmarks/vs_litellm.py.

LiteLLM enforces a key's `max_parallel_requests`, `rpm_limit` and `tpm_limit` in its built-in
parallel-request limiter; keys normally come from its Postgres database. This custom auth hands
out the same key objects from a JSON map instead (env BENCH_LITELLM_LIMITS: key → limits), so the
native limiter runs as it would with a database, minus the database's round trips.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fastapi import HTTPException, Request
from litellm.proxy._types import UserAPIKeyAuth

LIMITS: dict[str, dict[str, Any]] = json.loads(os.environ.get("BENCH_LITELLM_LIMITS", "{}"))


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    limits = LIMITS.get(api_key)
    if limits is None:
        raise HTTPException(status_code=401, detail="unknown key")
    return UserAPIKeyAuth(api_key=api_key, key_alias=limits.get("alias"), **limits.get("set", {}))
