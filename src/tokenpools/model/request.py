"""What one request asks for, and what it used."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestCost:
    """The estimate admission reserves against: prompt tokens and the output ceiling."""

    input_tokens: int
    # None → the entitlement's default (paper check 2); 0 for what generates nothing (embeddings)
    max_output_tokens: int | None = None
    sequences: int = 1  # generated from one prompt (`n`, `best_of`): each may reach the ceiling
    account: Account | None = None  # None: no budgets, no ledger (the simulator's requests)

    def __post_init__(self) -> None:
        if self.input_tokens < 0:
            raise ValueError(f"input_tokens must be >= 0, got {self.input_tokens}")
        if self.sequences < 1:
            raise ValueError(f"sequences must be >= 1, got {self.sequences}")
        if self.max_output_tokens is not None and self.max_output_tokens < 0:
            raise ValueError(f"max_output_tokens must be >= 0, got {self.max_output_tokens}")


@dataclass(frozen=True, slots=True)
class Usage:
    """What the backend reported when the request ended."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # of the input, served from the engine's prefix cache

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0 or self.cached_tokens < 0:
            raise ValueError(f"usage must be non-negative, got {self}")


@dataclass(frozen=True, slots=True)
class Account:
    """Who a request is charged to beyond its entitlement: budgets and the usage ledger."""

    tenant: str
    key: str  # the credential's label (a key's label, `jwt`, `header`)
    model: str  # the model name the client asked for
