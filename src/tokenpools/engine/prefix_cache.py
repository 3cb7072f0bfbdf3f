"""The engine's prefix cache: KV blocks a request leaves behind (it finished, was aborted, or
was preempted) stay in the free pool with their contents until an allocation needs them,
least recently used first — vLLM's automatic prefix caching (vllm/v1/core/kv_cache_manager.py,
block_pool.py: freed blocks go to the free queue's tail with their hashes; `get_new_blocks`
takes from its head, evicting the cached contents).

A prefix is named by a key (the simulator: the request a continuation continues; the emulator:
the text it starts with) instead of one hash per block: a request either continues a kept
prefix or shares nothing, which is all the workloads modelled here do. Cached blocks are free
blocks: they never hold back an admission, they are only lost to it.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["PrefixCache"]


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._kept: OrderedDict[str, int] = OrderedDict()  # key → tokens, oldest first
        self.blocks = 0  # Σ whole blocks kept (a partial last block is not reusable)
        self.hit_tokens = 0  # Σ tokens served from the cache, since the engine started

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, key: str, tokens: int) -> None:
        """A request left `tokens` tokens of KV under `key`: the most recently used now. Only
        whole blocks are reusable (vLLM hashes full blocks only)."""
        whole = tokens // self.block_size
        if whole <= 0:
            return
        old = self._kept.pop(key, 0)
        self.blocks -= old // self.block_size
        tokens = max(old, whole * self.block_size)
        self._kept[key] = tokens
        self.blocks += tokens // self.block_size

    def peek(self, key: str, prompt_tokens: int) -> int:
        """Tokens of a `prompt_tokens` prompt the cache holds under `key`. At least one token is
        always computed: the step that samples the next token needs its logits."""
        return min(self._kept.get(key, 0), max(0, prompt_tokens - 1))

    def take(self, key: str, prompt_tokens: int) -> int:
        """The request starts: its cached blocks are in use again (out of the cache)."""
        hit = self.peek(key, prompt_tokens)
        if key in self._kept:
            self.blocks -= self._kept.pop(key) // self.block_size
        self.hit_tokens += hit
        return hit

    def trim(self, free_blocks: int) -> None:
        """Allocations took all but `free_blocks` of the free blocks: cached contents beyond
        that are overwritten, least recently used first."""
        kept = self._kept
        while kept and self.blocks > free_blocks:
            _, tokens = kept.popitem(last=False)
            self.blocks -= tokens // self.block_size
