"""A token pool: an autoscaling group of identical inference replicas serving one model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from tokenpools.model.budgets import Prices
from tokenpools.model.profile import ModelProfile
from tokenpools.model.resources import Resources


@dataclass(frozen=True, slots=True)
class Backend:
    """One inference server of a pool (vLLM, llama.cpp, the emulator): an OpenAI-compatible
    base URL such as http://127.0.0.1:8000."""

    url: str
    timeout_s: float = 600.0
    model: str | None = None  # the name this backend serves; None: the name the client sent
    api_key_env: str | None = None  # where its API key is: an environment variable
    api_key_file: str | None = None  # or a file (a mounted Secret); read at start and reload
    # or the key itself, as a cluster gives it (a Secret in the platform's namespace)
    api_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class CapacityFeedback:
    """Parameters of the capacity-feedback control law (control/feedback.py)."""

    waiting_threshold: float = 1.0
    kv_threshold: float = 0.95
    decrease: float = 0.1
    increase: float = 0.05
    min_fraction: float = 0.5
    interval_s: float = 2.0


# How a pool's engines order their queues: vLLM's --scheduling-policy. One declaration for the
# config, the engine model, the simulator's scenarios and the emulator.
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    model: ModelProfile
    per_replica: Resources  # tokens/s, KV tokens, sequences of one replica
    replicas: int
    min_replicas: int
    max_replicas: int
    slo_reference_ms: float | None = None  # pins ℓ̄*; None → mean over Bound entitlements
    input_token_weight: float = 1.0
    output_token_weight: float = 1.0
    backends: tuple[Backend, ...] = ()
    served_models: tuple[str, ...] = ()  # model names clients send; empty: the pool's name
    capacity_feedback: CapacityFeedback | None = None
    tokenizer: str = "estimate"  # how the gateway counts prompt tokens: estimate, backend, a file
    prices: Prices = field(default_factory=Prices)  # micro-units per million tokens
    # how the pool's engines order their queues (vLLM's --scheduling-policy): "priority" has
    # the gateway write each admitted request's class priority into its body
    scheduling_policy: SchedulingPolicy = "fcfs"
    chat_continuation: bool = True  # the engines continue a final assistant message

    @property
    def models(self) -> tuple[str, ...]:
        return self.served_models or (self.name,)

    @property
    def capacity(self) -> Resources:
        return self.per_replica.scale(self.replicas)

    def with_replicas(self, replicas: int) -> Pool:
        if replicas < 0:
            raise ValueError(f"pool {self.name!r}: replicas must be >= 0, got {replicas}")
        return replace(self, replicas=replicas)
