"""How many prompt tokens a request brings, per pool (`tokenizer:` in the pool's config):

- `estimate`: characters per token (prompt.py); free, and corrected at settlement;
- `backend`: the engine's own count, asked by the host that can reach the engines (the gateway:
  gateway/backend_tokens.py); a host that cannot, or an engine that fails, gets the estimate;
- a file: a `tokenizer.json`, or the tokenizer and chat template inside a GGUF model
  (tokenizing/tokenizer_file.py, the `tokenizer` extra).

Whatever fails falls back to the estimate, and is counted."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tokenpools.prompt import estimate_prompt_tokens
from tokenpools.tokenizing.tokenizer_file import load_tokenizer

ESTIMATE, BACKEND = "estimate", "backend"
# the engine's count for (body, path), or None when it could not be had
AskBackend = Callable[[dict[str, Any], str], Awaitable[int | None]]


class PromptCounter:
    """One pool's way to count; `fallbacks` is how often the estimate stood in."""

    def __init__(self, mode: str, chars_per_token: float) -> None:
        self.mode = mode
        self.chars_per_token = chars_per_token
        self.tokenizer = None if mode in (ESTIMATE, BACKEND) else load_tokenizer(Path(mode))
        self.fallbacks = 0

    async def count(self, body: dict[str, Any], path: str, ask: AskBackend | None = None) -> int:
        if self.tokenizer is not None:
            return self.tokenizer.count(body)
        if self.mode == BACKEND:
            counted = None if ask is None else await ask(body, path)
            if counted is not None:
                return counted
            self.fallbacks += 1
        return estimate_prompt_tokens(body, self.chars_per_token)
