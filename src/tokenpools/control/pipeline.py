"""Admission of one request, written once: prepare its layers' reservations → one store step
(one layer or several, the same step: `Store.admit_first`) → decide → if the budgets allow the
request with a lower `max_tokens` and the config says lower it, prepare and run that request
once more. Every runner follows this one description: `run` with the core's own store
(`DecisionCore.admit`: the simulator, tests, check-config), and the admission driver awaiting
a shared store (`DecisionCore.admission`, run by admission/driver.py). Neither repeats a rule.

The description is a generator (the sans-I/O shape of h11): it yields each store step's
reservations, is sent back what the store did with them (None: the store was unreachable, and
the outage policy decides), and returns the decision."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import replace

from tokenpools.control.decisions import Admit, Decision, Reject
from tokenpools.control.gatekeeper import Gatekeeper, Pending
from tokenpools.control.layers import decide_layers, prepare_layers
from tokenpools.control.store import Outcome, StoreUnavailable
from tokenpools.model.request import RequestCost

# Yields a store step's reservations, is sent their outcomes (None: no store), returns the
# decision.
Admission = Generator[list[Pending], list[Outcome] | None, Decision]


def admission(
    gate: Gatekeeper,
    names: Sequence[str],
    cost: RequestCost,
    now: float,
    request_id: str | None = None,
) -> Admission:
    """The admission of a request of the layers `names` (one entitlement: one name)."""
    decision = yield from _attempt(gate, names, cost, now, request_id)
    if (lowered := _lowered(decision, cost)) is not None:
        again = yield from _attempt(gate, names, lowered, now, request_id)
        if isinstance(again, Admit):
            return replace(again, lowered=True)
    return decision


def _lowered(decision: Decision, cost: RequestCost) -> RequestCost | None:
    """The request once more with a lower `max_tokens`, where its budgets allow what they have
    left (the config says whether to lower: `max_tokens_fit` is 0 otherwise; the host says
    whether it can send a lower one: `RequestCost.lowerable`)."""
    if isinstance(decision, Reject) and decision.max_tokens_fit > 0 and cost.lowerable:
        return replace(cost, max_output_tokens=decision.max_tokens_fit)
    return None


def _attempt(
    gate: Gatekeeper,
    names: Sequence[str],
    cost: RequestCost,
    now: float,
    request_id: str | None,
) -> Admission:
    steps = prepare_layers(gate, names, cost, now, request_id)
    if isinstance(steps, Reject):
        return steps
    tried = yield steps
    return decide_layers(gate, steps, tried, now)


def run(
    gate: Gatekeeper,
    names: Sequence[str],
    cost: RequestCost,
    now: float,
    request_id: str | None = None,
) -> Decision:
    """Admit a request on the gatekeeper's own store, synchronously: the same steps as
    `admission`, called directly (the simulator and the benchmarks run this once per request,
    and a generator's frames cost them a sixth of their time)."""
    decision = _run_attempt(gate, names, cost, now, request_id)
    if (lowered := _lowered(decision, cost)) is not None:
        again = _run_attempt(gate, names, lowered, now, request_id)
        if isinstance(again, Admit):
            return replace(again, lowered=True)
    return decision


def _run_attempt(
    gate: Gatekeeper,
    names: Sequence[str],
    cost: RequestCost,
    now: float,
    request_id: str | None,
) -> Decision:
    if len(names) == 1:
        # one layer, without the lists (what `prepare_layers`/`decide_layers` do for one)
        lease_id = request_id if request_id is not None else gate.new_lease_id()
        step = gate.prepare(names[0], cost, now, lease_id)
        if isinstance(step, Reject):
            return step
        try:
            outcome: Outcome | None = gate.store.admit(step, now)
        except StoreUnavailable:
            outcome = None
        return gate.decide(step, outcome, now)
    steps = prepare_layers(gate, names, cost, now, request_id)
    if isinstance(steps, Reject):
        return steps
    try:
        tried: list[Outcome] | None = gate.store.admit_first(steps, now)
    except StoreUnavailable:
        tried = None
    return decide_layers(gate, steps, tried, now)
