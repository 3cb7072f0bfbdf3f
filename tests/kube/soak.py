"""The operator under failing writes for many simulated minutes (tests/test_k8s_trust.py
asserts on it; benchmarks/operator_faults.py reports it per seed).

Two pools, four entitlements of different classes in one tenant namespace, one namespace that
refuses every lease pod (403, as a quota or webhook would), and a share of all writes failing
with 500. The operator's own loop (`OperatorLoop`, as `kopf run` drives it: heartbeat every
10 s, reconciliation on a wake every 30 s and on resync) runs against the API stand-in, the
scheduler stand-in between its steps; then, with the faults gone, one edit, and the passes
until nothing more is written."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from tests.kube.api_faults import Fault
from tests.kube.harness import NS, PLATFORM, TENANT_LABEL, Bench, ent, pool
from tokenpools.k8s import objects as o
from tokenpools.k8s.api import ENTITLEMENTS, POOLS
from tokenpools.k8s.leader import LeaderElection
from tokenpools.k8s.names import node_name
from tokenpools.k8s.operator_loop import HEARTBEAT_S, OperatorLoop

POOLS_ = ("qwen", "llama")
MAX_PASSES = 10


@dataclass
class SoakResult:
    bound_before: set[str]
    writes: int = 0
    failed: int = 0
    worst_lease_age_s: float = 0.0  # the oldest any node Lease got (its duration is 40 s)
    lost: list[tuple[int, str]] = field(default_factory=list)  # (tick, entitlement) not Bound
    pods_replaced: int = 0
    passes_to_settle: int = 0
    applied_after_edit: object = None


def soak(bench: Bench, seed: int, rate: float, minutes: int = 12) -> SoakResult:
    api, kube, clock = bench.server.api, bench.kube, bench.clock
    bench.namespace("strict", TENANT_LABEL)
    for p in POOLS_:
        kube.create(POOLS, None, pool(p, servedModels=[p]))
    for i, cls in enumerate(("guaranteed", "elastic", "dedicated", "spot")):
        kube.create(ENTITLEMENTS, NS, ent(f"t{i}", cls, 2, pool=POOLS_[i % 2]))
    kube.create(ENTITLEMENTS, "strict", ent("blocked", "guaranteed", 2))
    bench.settle()
    out = SoakResult({k for k, v in bench.states().items() if v == "Bound"})
    uids = {p["metadata"]["uid"] for e in out.bound_before for p in bench.leases(e)}
    api.random.seed(seed)
    api.faults[:] = [Fault("create", "pods", "strict", status=403),
                     Fault("write", "*", None, status=500, rate=rate)]  # fmt: skip
    first = len(api.writes)
    loop = OperatorLoop(bench.rec, LeaderElection(kube, PLATFORM, "op-0", clock), clock)
    for tick in range(minutes * 6):  # 10 s steps
        clock.now += HEARTBEAT_S
        loop.heartbeat()
        if loop.reconcile_due(woken=tick % 3 == 0):
            loop.reconcile()
        with contextlib.suppress(Exception):  # the scheduler's writes fail too; next round
            bench.sched.run()
        leases = api.store[("coordination.k8s.io/v1", "leases")]
        for name in map(node_name, POOLS_):
            renewed = o.parse_time(leases[(o.NODE_LEASE_NAMESPACE, name)]["spec"]["renewTime"])
            out.worst_lease_age_s = max(out.worst_lease_age_s, clock.now - renewed)
        bound = {k for k, v in bench.states().items() if v == "Bound"}
        out.lost += [(tick, e) for e in sorted(out.bound_before - bound)]
    done = api.writes[first:]
    out.writes, out.failed = len(done), sum(1 for w in done if w[3] >= 400)
    now = {p["metadata"]["uid"] for e in out.bound_before for p in bench.leases(e)}
    out.pods_replaced = len(uids - now)
    api.faults.clear()
    clock.now += 600  # past every backoff
    loop.reconcile()
    kube.patch(ENTITLEMENTS, NS, "t0", {"spec": {"sloTargetMs": 900}})
    while out.passes_to_settle < MAX_PASSES:
        before = len(api.writes)
        loop.reconcile()
        bench.sched.run()
        out.passes_to_settle += 1
        if len(api.writes) == before:
            break
    applied = kube.get(ENTITLEMENTS, NS, "t0")["status"]["appliedSpec"]
    out.applied_after_edit = applied.get("sloTargetMs")
    return out
