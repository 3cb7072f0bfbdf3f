"""Model profiles: how many KV-cache bytes one token of sequence state costs."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: float  # 2 for fp16/bf16 KV cache, 1 for fp8

    @property
    def kv_bytes_per_token(self) -> float:
        """c = 2 · L · H_kv · d_h · b (keys and values, every layer)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element

    def kv_tokens_for_gib(self, gib: float) -> float:
        return gib * GIB / self.kv_bytes_per_token


# Architecture numbers from each model's published config.json; KV cache in 16-bit.
BUILTIN_PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile("Qwen3-8B", layers=36, kv_heads=8, head_dim=128, bytes_per_element=2),
        ModelProfile("Llama-3.1-8B", layers=32, kv_heads=8, head_dim=128, bytes_per_element=2),
        ModelProfile("Llama-3.1-70B", layers=80, kv_heads=8, head_dim=128, bytes_per_element=2),
        ModelProfile("SmolLM2-135M", layers=30, kv_heads=3, head_dim=64, bytes_per_element=2),
    )
}
