"""What one request asks for, and what it used.

Built on every request, so each writes its `__init__` out: mypyc compiles a written one, where
the one @dataclass generates runs interpreted (control/store_terms.py says more, above Lease)."""

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
    # the host can suspend and resume it (docs/decisions.md, "Lending, and taking back"); a
    # spot or elastic request that cannot be resumed is never lent (taking it back would end it)
    resumable: bool = True
    # the host can end it while it runs; a request it cannot (Envoy's ext_authz lets a request
    # on and sees it again only in the access log) is never lent, preemptible work included
    endable: bool = True
    # the host can send a lower ceiling than the request's, where a budget has less left (a
    # `lowerMaxTokens` budget); one that cannot (ext_authz) is refused instead
    lowerable: bool = True

    def __init__(
        self,
        input_tokens: int,
        max_output_tokens: int | None = None,
        sequences: int = 1,
        account: Account | None = None,
        resumable: bool = True,
        endable: bool = True,
        lowerable: bool = True,
    ) -> None:
        if input_tokens < 0:
            raise ValueError(f"input_tokens must be >= 0, got {input_tokens}")
        if sequences < 1:
            raise ValueError(f"sequences must be >= 1, got {sequences}")
        if max_output_tokens is not None and max_output_tokens < 0:
            raise ValueError(f"max_output_tokens must be >= 0, got {max_output_tokens}")
        object.__setattr__(self, "input_tokens", input_tokens)
        object.__setattr__(self, "max_output_tokens", max_output_tokens)
        object.__setattr__(self, "sequences", sequences)
        object.__setattr__(self, "account", account)
        object.__setattr__(self, "resumable", resumable)
        object.__setattr__(self, "endable", endable)
        object.__setattr__(self, "lowerable", lowerable)


@dataclass(frozen=True, slots=True)
class Usage:
    """What the backend reported when the request ended."""

    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # of the input, served from the engine's prefix cache

    def __init__(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> None:
        if input_tokens < 0 or output_tokens < 0 or cached_tokens < 0:
            raise ValueError(
                f"usage must be non-negative, got input_tokens={input_tokens}, "
                f"output_tokens={output_tokens}, cached_tokens={cached_tokens}"
            )
        object.__setattr__(self, "input_tokens", input_tokens)
        object.__setattr__(self, "output_tokens", output_tokens)
        object.__setattr__(self, "cached_tokens", cached_tokens)


@dataclass(frozen=True, slots=True)
class Account:
    """Who a request is charged to beyond its entitlement: budgets and the usage ledger."""

    tenant: str
    key: str  # the credential's label (a key's label, `jwt`, `header`)
    model: str  # the model name the client asked for

    def __init__(self, tenant: str, key: str, model: str) -> None:
        object.__setattr__(self, "tenant", tenant)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "model", model)
