"""Tunable parameters of the decision core. Defaults follow the paper where it gives numbers."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenpools.model.service_class import CLASS_SEMANTICS, ServiceClass


def _default_weights() -> dict[ServiceClass, float]:
    return {cls: sem.weight for cls, sem in CLASS_SEMANTICS.items()}


def _default_deadlines() -> dict[ServiceClass, float]:
    # Batch-like classes wait long for room; interactive ones about a client's patience.
    return {
        ServiceClass.DEDICATED: 60.0,
        ServiceClass.GUARANTEED: 60.0,
        ServiceClass.ELASTIC: 120.0,
        ServiceClass.SPOT: 300.0,
        ServiceClass.PREEMPTIBLE: 600.0,
    }


@dataclass(frozen=True, slots=True)
class Policy:
    class_weights: dict[ServiceClass, float] = field(default_factory=_default_weights)
    alpha_slo: float = 2.0
    alpha_burst: float = 1.0
    alpha_debt: float = 4.0
    gamma_debt: float = 0.7  # the paper's hand-tuned value
    gamma_burst: float = 0.7
    update_period_s: float = 5.0  # debt/burst update; also the usage-observation window
    burst_window_s: float = 60.0  # token-bucket depth = rate × this (TPM-like)
    headroom: float = 0.25  # near full: within this fraction of capacity
    contention_window_s: float = 0.5  # a refusal this recent is unmet demand (check 5)
    # check 5: a request yields only to priorities above its own by more than this fraction
    priority_margin: float = 0.2
    overcommit: float = 0.1  # protected classes may exceed capacity by this fraction
    # spot and preemptible work leave free what the others are expected to claim back: their
    # recent peaks, fading with this time constant (control/backfill.py); 0: nothing claimed
    backfill_window_s: float = 40.0
    # the share of its admitted requests a preemptible tenant's admission aims to complete
    preemptible_completion_target: float = 0.8
    elastic_oversubscription: float = 1.5  # elastic baselines bind while Σ ≤ capacity × this
    default_max_tokens: int = 256
    lease_ttl_s: float = 600.0
    retry_after_min_s: float = 1.0
    retry_after_max_s: float = 60.0
    retry_after_jitter: float = 0.2  # ± fraction, derived from the request id
    # Lent work taken back is suspended (kept, resumed when room returns) rather than ended
    # (docs/decisions.md, "Lending, and taking back"); one suspended longer than its class's
    # deadline here ends as an evicted request does.
    suspend: bool = True
    suspend_deadline_s: dict[ServiceClass, float] = field(default_factory=_default_deadlines)
