"""The core's binding and a kube-scheduler stand-in reach the same Bound / Degraded / Pending
outcome, over random entitlement sets, arrivals, departures and capacity changes."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.builders import make_config
from tests.kube.scheduler import Bind, Preempt, SNode, SPod, queue_order, schedule_one
from tokenpools.control.core import DecisionCore
from tokenpools.control.placement import (
    PRIORITY_CLASSES,
    Placed,
    lease_requests,
    pool_allocatable,
    survivors,
)
from tokenpools.model.config import Config
from tokenpools.model.entitlement import BindingState, Entitlement
from tokenpools.state.memory import MemoryStore

TOLERATION = {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}
TAINT = {"key": "virtual-kubelet.io/provider", "value": "tokenpools", "effect": "NoSchedule"}


class StandInCluster:
    """One virtual node, lease pods, the stand-in scheduler, and the operator's kubelet rules
    (evicted or preempted lease pods are recreated and queue again)."""

    def __init__(self) -> None:
        self.clock = itertools.count(1)
        self.node = SNode("p", {}, {"tokenpools.io/pool": "p"}, [TAINT])
        self.pods: dict[str, SPod] = {}
        self.ever_bound: set[str] = set()

    def add(self, ent: Entitlement) -> None:
        pc = PRIORITY_CLASSES[ent.service_class]
        self.pods[ent.name] = SPod(
            ent.name,
            pc.value,
            lease_requests(ent),
            next(self.clock),
            preempts=pc.preempts,
            tolerations=[TOLERATION],
            node_selector={"tokenpools.io/pool": "p"},
        )

    def remove(self, name: str) -> None:
        del self.pods[name]
        self.ever_bound.discard(name)

    def _requeue(self, names: list[str]) -> None:
        for name in names:
            pod = self.pods[name]
            self.pods[name] = SPod(
                name,
                pod.priority,
                pod.requests,
                next(self.clock),
                pod.preempts,
                pod.tolerations,
                pod.node_selector,
            )

    def set_allocatable(self, alloc: dict[str, int]) -> None:
        self.node = SNode("p", {**alloc, "pods": 1000}, self.node.labels, self.node.taints)
        bound = [p for p in self.pods.values() if p.node is not None]
        placed = [Placed(p.name, p.priority, p.requests, p.started) for p in bound]
        kept = survivors(placed, self.node.allocatable)
        order = sorted(bound, key=lambda p: (-p.priority, p.started, p.name))
        self._requeue([p.name for p in order if p.name not in kept])
        self.settle()

    def settle(self) -> None:
        progress = True
        while progress:
            progress = False
            for pod in queue_order(list(self.pods.values())):
                outcome = schedule_one(pod, [self.node], list(self.pods.values()))
                if isinstance(outcome, Bind):
                    self.pods[pod.name] = SPod(
                        pod.name,
                        pod.priority,
                        pod.requests,
                        pod.queued,
                        pod.preempts,
                        pod.tolerations,
                        pod.node_selector,
                        node=outcome.node,
                        started=next(self.clock),
                    )
                    self.ever_bound.add(pod.name)
                elif isinstance(outcome, Preempt):
                    victims = [self.pods[v] for v in outcome.victims]
                    victims.sort(key=lambda p: (-p.priority, p.started, p.name))
                    self._requeue([v.name for v in victims])
                else:
                    continue
                progress = True
                break

    def states(self) -> dict[str, BindingState]:
        out = {}
        for name, pod in self.pods.items():
            if pod.node is not None:
                out[name] = BindingState.BOUND
            elif name in self.ever_bound:
                out[name] = BindingState.DEGRADED
            else:
                out[name] = BindingState.PENDING
        return out


CLASSES = ["dedicated", "guaranteed", "elastic", "spot", "preemptible"]

entitlement = st.fixed_dictionaries(
    {
        "serviceClass": st.sampled_from(CLASSES),
        "concurrency": st.integers(0, 12),
        "tokensPerSecond": st.integers(0, 400),
        "kvTokens": st.integers(0, 20000),
    }
)
event = st.one_of(
    st.tuples(st.just("add"), entitlement),
    st.tuples(st.just("remove"), st.integers(0, 30)),
    st.tuples(st.just("replicas"), st.integers(0, 3)),
)


def _config(ents: dict[str, dict[str, Any]], replicas: int) -> Config:
    return make_config(
        [{"name": n, **spec} for n, spec in ents.items()], replicas=replicas, kv_tokens=32768
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(event, min_size=1, max_size=25))
def test_core_binding_agrees_with_the_scheduler(events: list[tuple[str, Any]]) -> None:
    ents: dict[str, dict[str, Any]] = {}
    replicas = 1
    config = _config(ents, replicas)
    core = DecisionCore(config, MemoryStore(), now=0.0)
    cluster = StandInCluster()
    cluster.set_allocatable(
        pool_allocatable(config.pools["p"], config.policy.elastic_oversubscription)
    )
    names = itertools.count()
    for kind, arg in events:
        if kind == "add":
            name = f"e{next(names)}"
            ents[name] = arg
            config = _config(ents, core.pools["p"].pool.replicas)
            core.apply_config(config, now=0.0)
            cluster.add(config.entitlements[name])
            cluster.settle()
        elif kind == "remove" and ents:
            name = sorted(ents)[arg % len(ents)]
            del ents[name]
            config = _config(ents, core.pools["p"].pool.replicas)
            core.apply_config(config, now=0.0)
            cluster.remove(name)
            cluster.settle()
        elif kind == "replicas":
            replicas = arg
            core.set_replicas("p", replicas, now=0.0)
            pool = core.pools["p"].pool
            cluster.set_allocatable(pool_allocatable(pool, config.policy.elastic_oversubscription))
        got = {n: v.state for n, v in core.entitlements.items()}
        assert got == cluster.states(), (kind, arg)


def test_a_guaranteed_arrival_preempts_an_elastic_which_turns_degraded() -> None:
    ents = {
        "e": {"serviceClass": "elastic", "concurrency": 16},
        "s": {"serviceClass": "spot", "concurrency": 4},
    }
    config = _config(ents, 1)
    cluster = StandInCluster()
    cluster.set_allocatable(pool_allocatable(config.pools["p"], 1.5))
    for ent in config.entitlements.values():
        cluster.add(ent)
    cluster.settle()
    assert cluster.states() == {"e": BindingState.BOUND, "s": BindingState.BOUND}
    ents["g"] = {"serviceClass": "guaranteed", "concurrency": 12}
    cluster.add(_config(ents, 1).entitlements["g"])
    cluster.settle()
    # 12 + 16 shared slots > 24: the elastic lease pod is the victim, spot (no baseline) stays
    assert cluster.states() == {
        "e": BindingState.DEGRADED,
        "s": BindingState.BOUND,
        "g": BindingState.BOUND,
    }


def test_preemption_policy_never_waits_and_equal_priority_never_preempts() -> None:
    node = SNode("n", {"tokenpools.io/concurrency": 4, "pods": 10})
    low = SPod("low", 10, {"tokenpools.io/concurrency": 4}, 1, node="n", started=2)
    same = SPod("same", 10, {"tokenpools.io/concurrency": 1}, 3)
    waits = SPod("waits", 99, {"tokenpools.io/concurrency": 1}, 4, preempts=False)
    high = SPod("high", 99, {"tokenpools.io/concurrency": 1}, 5)
    pods = [low, same, waits, high]
    assert schedule_one(same, [node], pods) is None
    assert schedule_one(waits, [node], pods) is None
    assert schedule_one(high, [node], pods) == Preempt("high", "n", ("low",))


def test_taints_and_node_selectors_keep_pods_off_nodes() -> None:
    tainted = SNode("v", {"pods": 10}, {"tokenpools.io/pool": "p"}, [TAINT])
    plain = SPod("plain", 0, {}, 1)
    lease = SPod(
        "lease", 0, {}, 2, tolerations=[TOLERATION], node_selector={"tokenpools.io/pool": "p"}
    )
    elsewhere = SPod(
        "x", 0, {}, 3, tolerations=[TOLERATION], node_selector={"tokenpools.io/pool": "q"}
    )
    assert schedule_one(plain, [tainted], []) is None
    assert schedule_one(lease, [tainted], []) == Bind("lease", "v")
    assert schedule_one(elsewhere, [tainted], []) is None
