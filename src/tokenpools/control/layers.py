"""Layered entitlements: a tenant that holds several entitlements in one pool (say guaranteed
8 slots, and spot beyond them) sends one request; it is tried against each of them in layer
order, in one store step (one round trip on Redis), and the first with room admits it and is
charged. The layer order (control/tenancy.py): the class (dedicated, guaranteed, elastic, spot,
preemptible), then the name. A refusal of every layer answers with the soonest Retry-After.
The runners that admit a request (control/pipeline.py) prepare and decide it here."""

from __future__ import annotations

from collections.abc import Sequence

from tokenpools.control.decisions import Admit, Decision, Reject
from tokenpools.control.gatekeeper import Gatekeeper, Pending
from tokenpools.control.store import Outcome
from tokenpools.model.request import RequestCost


def prepare_layers(
    gate: Gatekeeper,
    names: Sequence[str],
    cost: RequestCost,
    now: float,
    request_id: str | None = None,
) -> list[Pending] | Reject:
    """Each layer's reservation, all under one lease id; a layer that cannot take the request
    at all (not bound, expired, too small for it) is left out. None left: the first layer's
    refusal."""
    lease_id = request_id if request_id is not None else gate.new_lease_id()
    steps: list[Pending] = []
    refused: Reject | None = None
    for name in names:
        step = gate.prepare(name, cost, now, lease_id)
        if isinstance(step, Reject):
            refused = refused or step
        else:
            steps.append(step)
    if steps:
        return steps
    assert refused is not None, "a request has at least one layer"
    return refused


def decide_layers(
    gate: Gatekeeper, steps: Sequence[Pending], tried: Sequence[Outcome] | None, now: float
) -> Decision:
    """The decision from the outcomes of the layers the store tried (None: the store was
    unreachable, and the outage policy decides, layer by layer)."""
    if tried is None:
        refusals: list[Reject] = []
        for step in steps:
            decision = gate.decide(step, None, now)
            if isinstance(decision, Admit):
                return decision
            refusals.append(decision)
        return refusals[0]
    if tried[-1].shortfall is None:
        return gate.decide(steps[len(tried) - 1], tried[-1], now)
    return soonest([gate.decide(s, o, now) for s, o in zip(steps, tried, strict=False)])


def charged_to(decision: Decision, names: Sequence[str]) -> str:
    """The entitlement a decision counts on: the layer that admitted it, else the first."""
    return decision.lease.entitlement if isinstance(decision, Admit) else names[0]


def soonest(decisions: Sequence[Decision]) -> Decision:
    """The refusal to answer with: the one whose retry is expected soonest (the first layer's
    among equals; one that can never succeed only if all are such)."""
    best = decisions[0]
    for d in decisions[1:]:
        if (
            isinstance(d, Reject)
            and isinstance(best, Reject)
            and d.retry_after_s is not None
            and (best.retry_after_s is None or d.retry_after_s < best.retry_after_s)
        ):
            best = d
    return best
