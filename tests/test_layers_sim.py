"""What layered entitlements buy, in the simulator, on a generated family of pools: a tenant
holding a guaranteed baseline and spot beyond it, its closed-loop clients more than its
baseline, beside a backlogged spot tenant. One identity (layers: guaranteed, then spot) against
the same demand split over two keys (half the clients on the guaranteed key, half on the spot
key: a client that must choose per request does not know which has room) and against the
guaranteed key alone."""

from __future__ import annotations

from typing import Any

import pytest

from tokenpools.sim.metrics import summarize
from tokenpools.sim.scenario import Scenario
from tokenpools.sim.simulator import simulate

FAMILY = [  # (pool slots, acme's guaranteed slots, acme's clients, batch's clients)
    (16, 4, 10, 8),
    (16, 8, 14, 4),
    (24, 6, 16, 12),
    (12, 4, 12, 2),
    (32, 12, 16, 16),
]


def closed(name: str, clients: int, entitlement: str, **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "entitlement": entitlement,
        "retry": {"max_tries": 1000},
        "workload": {
            "arrivals": {"kind": "closed", "clients": clients, "think_s": 0.0},
            "prompt": {"kind": "fixed", "value": 64},
            "output": {"kind": "fixed", "value": 64},
        },
        **more,
    }


def scenario(slots: int, gold: int, clients: int, batch: int, how: str) -> Scenario:
    if how == "layers":
        acme = [closed("acme", clients, "acme-gold", layered=True)]
    elif how == "two keys":
        half = clients // 2
        acme = [closed("acme", half, "acme-gold"), closed("acme-2", clients - half, "acme-spot")]
    else:
        acme = [closed("acme", clients, "acme-gold")]
    ents = [
        {"name": "acme-gold", "tenantId": "acme", "serviceClass": "guaranteed",
         "concurrency": gold},
        {"name": "acme-spot", "tenantId": "acme", "serviceClass": "spot"},
        {"name": "batch", "tenantId": "batch", "serviceClass": "spot"},
    ]  # fmt: skip
    return Scenario.model_validate({
        "name": f"layers-{slots}-{gold}-{clients}-{batch}-{how}",
        "duration_s": 40,
        "engine": {"profile": "paper-dgx-spark-qwen3-8b"},
        "tokenpools": {
            "pools": [{"name": "p", "model": "Qwen3-8B", "perReplica": {
                "tokensPerSecond": 4000, "kvTokens": 65536, "concurrency": slots}}],
            "entitlements": [{"pool": "p", **e} for e in ents],
        },
        "phases": [{"name": "all", "start_s": 0, "end_s": 40}],
        "tenants": [*acme, closed("batch", batch, "batch")],
    })  # fmt: skip


def completed(how: str, case: tuple[int, int, int, int]) -> tuple[int, int]:
    """acme's completed requests (all its keys), and batch's."""
    tenants = summarize(simulate(scenario(*case, how), "tokenpools"))["tenants"]
    acme = sum(t["totals"]["completed"] for n, t in tenants.items() if n.startswith("acme"))
    return acme, tenants["batch"]["totals"]["completed"]


@pytest.mark.parametrize("case", FAMILY, ids=lambda c: "-".join(map(str, c)))
def test_one_identity_with_layers_serves_at_least_what_two_keys_do(
    case: tuple[int, int, int, int],
) -> None:
    layered, _ = completed("layers", case)
    two_keys, _ = completed("two keys", case)
    one_key, _ = completed("guaranteed only", case)
    assert layered > one_key * 1.1, (layered, one_key)  # it bursts onto spot
    # at least what two keys do, within 5 % (32-12-16-16 gives 80 against 84 under the
    # claims of docs/decisions.md, "Preemptible work that completes"; 80 against 80 before)
    assert layered >= 0.95 * two_keys, (layered, two_keys)
