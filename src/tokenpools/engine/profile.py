"""Engine profiles: the numbers that make one engine model behave like one real deployment."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class EngineProfile(BaseModel):
    """Step time = t0_s + prefill_s_per_token·prefill_tokens + decode_s_per_seq·decode_seqs
    + kv_read_s_per_token·kv_tokens_in_use (the last term is 0 unless a profile fits it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    max_num_seqs: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)  # per-step token budget (chunked prefill)
    kv_blocks: int = Field(gt=0)
    block_size: int = Field(default=16, gt=0)
    watermark: float = Field(default=0.01, ge=0, lt=1)  # free blocks kept back at admission
    t0_s: float = Field(ge=0)
    prefill_s_per_token: float = Field(ge=0)
    decode_s_per_seq: float = Field(ge=0)
    kv_read_s_per_token: float = Field(default=0.0, ge=0)
    prefix_caching: bool = True  # vLLM v1's default (engine/prefix_cache.py)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def limits_at(self, fraction: float) -> tuple[int, int]:
        """(slots, KV blocks) of a replica that keeps `fraction` of its own (a capacity event:
        a partial failure, a co-tenant's share); at least one of each."""
        return (
            max(1, round(self.max_num_seqs * fraction)),
            max(1, round(self.kv_blocks * fraction)),
        )

    def step_time(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        return (
            self.t0_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_seqs
            + self.kv_read_s_per_token * kv_tokens
        )

    def nominal_service_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """One request's time in a full batch of decoding sequences: what "demand in slots"
        converts with (slots = arrival rate × this)."""
        step = self.step_time(0, self.max_num_seqs, 0)
        prefill = self.prefill_s_per_token * prompt_tokens
        return prefill + step * output_tokens

    def faster(self, speed: float) -> EngineProfile:
        """The same engine with time running `speed` times faster (what `emulate --speed`
        serves), so demand in slots converts at the pace clients will see."""
        if speed <= 0 or speed == 1.0:
            return self
        times = ("t0_s", "prefill_s_per_token", "decode_s_per_seq", "kv_read_s_per_token")
        return self.model_copy(update={k: getattr(self, k) / speed for k in times})

    def output_tokens_per_s(self) -> float:
        """Total decode throughput with every slot busy."""
        return self.max_num_seqs / self.step_time(0, self.max_num_seqs, 0)


@dataclass(frozen=True)
class ProfileError(ValueError):
    message: str

    def __str__(self) -> str:
        return self.message


def builtin_profiles() -> list[str]:
    folder = resources.files("tokenpools.engine") / "profiles"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def load_profile(name_or_path: str) -> EngineProfile:
    """A built-in profile by name, or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        text = path.read_text()
    else:
        resource = resources.files("tokenpools.engine") / "profiles" / f"{name_or_path}.yaml"
        if not resource.is_file():
            known = ", ".join(builtin_profiles())
            raise ProfileError(f"unknown engine profile {name_or_path!r} (built-in: {known})")
        text = resource.read_text()
    try:
        return EngineProfile.model_validate(yaml.safe_load(text))
    except ValidationError as exc:
        raise ProfileError(f"engine profile {name_or_path!r}: {exc}") from None
