"""Property tests: random interleavings of arrivals, settles, releases, expiries, ticks and
capacity changes, checked against the guarantees the core promises."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.builders import make_config
from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Reject
from tokenpools.control.store import Lease
from tokenpools.model.entitlement import BindingState
from tokenpools.model.request import RequestCost, Usage
from tokenpools.state.memory import MemoryStore

EPS = 1e-6
NAMES = ["gold-a", "gold-b", "dedicated", "elastic-a", "elastic-b", "spot", "batch"]


class PoolMachine(RuleBasedStateMachine):
    core: DecisionCore

    @initialize(
        slots=st.integers(4, 16),
        shares=st.lists(st.integers(0, 4), min_size=3, max_size=3),
        overcommit=st.sampled_from([0.0, 0.1, 0.25]),
        headroom=st.sampled_from([0.0, 0.2, 0.4]),
    )
    def setup(self, slots: int, shares: list[int], overcommit: float, headroom: float) -> None:
        # Σ protected baselines ≤ capacity: every reserved share is scaled to fit one replica.
        total = sum(shares) or 1
        fit = [s * slots // max(total, slots) for s in shares]
        ents: list[dict[str, Any]] = [
            {
                "name": "gold-a",
                "serviceClass": "guaranteed",
                "sloTargetMs": 800,
                "concurrency": fit[0],
            },
            {
                "name": "gold-b",
                "serviceClass": "guaranteed",
                "sloTargetMs": 2000,
                "concurrency": fit[1],
            },
            {
                "name": "dedicated",
                "serviceClass": "dedicated",
                "sloTargetMs": 1000,
                "concurrency": fit[2],
            },
            {"name": "elastic-a", "serviceClass": "elastic", "sloTargetMs": 500, "concurrency": 3},
            {
                "name": "elastic-b",
                "serviceClass": "elastic",
                "sloTargetMs": 20000,
                "concurrency": 3,
                "burst": {"concurrency": 6},
            },
            {"name": "spot", "serviceClass": "spot"},
            {"name": "batch", "serviceClass": "preemptible"},
        ]
        self.config = make_config(
            ents,
            concurrency=slots,
            tokens_per_s=slots * 30,
            kv_tokens=slots * 512,
            replicas=1,
            policy={
                "overcommit": overcommit,
                "headroom": headroom,
                "leaseTtlS": 60,
                "burstWindowS": 10,
                "elasticOversubscription": 2.0,
            },
        )
        self.t = 0.0
        self.core = DecisionCore(self.config, MemoryStore(), now=self.t)
        self.live: dict[str, Lease] = {}
        self.before_shrink: set[str] = set()  # non-preemptible leases admitted before a shrink
        self.policy = self.config.policy

    # -- events ----------------------------------------------------------------------

    def advance(self, dt: float) -> None:
        self.t += dt

    @rule(
        name=st.sampled_from(NAMES),
        n_in=st.integers(0, 400),
        max_out=st.integers(1, 200),
        dt=st.floats(0, 3),
    )
    def arrive(self, name: str, n_in: int, max_out: int, dt: float) -> None:
        self.advance(dt)
        core = self.core
        view = core.entitlements[name]
        ent = view.ent
        cap = core.pools["p"].pool.capacity
        before = core.store.entitlement_counters(name, self.t)
        tokens, kv = float(n_in + max_out), float(n_in + max_out)
        within_baseline = (
            ent.protected
            and view.state == BindingState.BOUND
            and before.concurrency + 1 <= ent.baseline.concurrency
            and before.kv_tokens + kv <= ent.baseline.kv_tokens
            and before.bucket >= tokens
        )
        decision = core.admit(name, RequestCost(n_in, max_out), self.t)
        if isinstance(decision, Admit):
            for victim in decision.evict:
                assert victim.preemptible
                assert core.entitlements[victim.entitlement].priority < view.priority
                del self.live[victim.lease_id]
                self.before_shrink.discard(victim.lease_id)
            self.live[decision.lease.lease_id] = decision.lease
            after = core.store.pool_counters("p", self.t)
            limit = cap.scale(1 + self.policy.overcommit)
            assert after.concurrency <= limit.concurrency + EPS
            assert after.kv_tokens <= limit.kv_tokens + EPS
            depth = cap.throughput * self.policy.burst_window_s
            assert after.bucket >= -self.policy.overcommit * depth - EPS
            if decision.overcommit:
                assert ent.protected
                event("protected admitted into the overcommit")
            if decision.evict:
                event("admitted by evicting preemptible work")
        else:
            assert isinstance(decision, Reject)
            if decision.retry_after_s is not None:
                lo, hi = self.policy.retry_after_min_s, self.policy.retry_after_max_s
                assert lo <= decision.retry_after_s <= hi
            if within_baseline and not self.before_shrink:
                raise AssertionError(f"{name} rejected within its baseline: {decision}")
            event(f"rejected: {decision.reason}")

    @rule(data=st.data(), dt=st.floats(0, 3))
    def settle(self, data: st.DataObject, dt: float) -> None:
        if not self.live:
            return
        self.advance(dt)
        lease_id = data.draw(st.sampled_from(sorted(self.live)))
        lease = self.live.pop(lease_id)
        self.before_shrink.discard(lease_id)
        out = data.draw(st.integers(0, int(lease.kv_tokens)))
        n_in = int(lease.kv_tokens) - out
        assert self.core.settle(lease_id, Usage(n_in, out), self.t) is lease

    @rule(data=st.data(), refund=st.booleans())
    def release(self, data: st.DataObject, refund: bool) -> None:
        if not self.live:
            return
        lease_id = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[lease_id]
        self.before_shrink.discard(lease_id)
        assert self.core.release(lease_id, self.t, refund=refund) is not None

    @rule(dt=st.floats(0, 40))
    def tick(self, dt: float) -> None:
        self.advance(dt)
        result = self.core.tick(self.t)
        for lease in result.expired:
            assert lease.expires_at <= self.t
            del self.live[lease.lease_id]
            self.before_shrink.discard(lease.lease_id)

    @rule(replicas=st.integers(0, 3))
    def capacity_change(self, replicas: int) -> None:
        old = self.core.pools["p"].pool.capacity
        change = self.core.set_replicas("p", replicas, self.t)
        new = self.core.pools["p"].pool.capacity
        for lease in change.evict:
            assert lease.preemptible
            del self.live[lease.lease_id]
        if new.concurrency < old.concurrency:
            self.before_shrink |= {i for i, x in self.live.items() if not x.preemptible}
        counters = self.core.store.pool_counters("p", self.t)
        preemptible_left = counters.preemptible_concurrency
        if preemptible_left:  # evicted until the rest fits, or nothing preemptible is left
            assert counters.concurrency - 1 < new.concurrency + EPS or not change.evict

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def counters_match_the_live_leases(self) -> None:
        if not hasattr(self, "core"):
            return
        c = self.core.store.pool_counters("p", self.t)
        assert c.leases == len(self.live)
        assert c.concurrency == len(self.live)
        assert abs(c.kv_tokens - sum(x.kv_tokens for x in self.live.values())) < EPS
        pre = [x for x in self.live.values() if x.preemptible]
        assert c.preemptible_concurrency == len(pre)
        assert c.holdback_concurrency >= -EPS and c.holdback_kv >= -EPS
        for name in NAMES:
            e = self.core.store.entitlement_counters(name, self.t)
            mine = [x for x in self.live.values() if x.entitlement == name]
            assert e.concurrency == len(mine) and e.concurrency >= 0
            assert abs(e.kv_tokens - sum(x.kv_tokens for x in mine)) < EPS

    @invariant()
    def debt_stays_bounded(self) -> None:
        if not hasattr(self, "core"):
            return
        for name in NAMES:
            scores = self.core.store.scores(name, self.t)
            assert -1 - EPS <= scores.debt <= 1 + EPS
            assert scores.burst >= 0
            assert self.core.entitlements[name].priority > 0 or name == "batch"

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for lease_id in list(self.live):
            self.core.release(lease_id, self.t)
        c = self.core.store.pool_counters("p", self.t)
        assert (c.concurrency, c.kv_tokens, c.leases) == (0, 0, 0)
        assert (c.preemptible_concurrency, c.preemptible_kv) == (0, 0)
        bound_protected = [
            v.ent
            for v in self.core.entitlements.values()
            if v.ent.protected and v.state == BindingState.BOUND
        ]
        assert (
            abs(c.holdback_concurrency - sum(e.baseline.concurrency for e in bound_protected)) < EPS
        )
        for name in NAMES:
            e = self.core.store.entitlement_counters(name, self.t)
            assert (e.concurrency, e.kv_tokens, e.leases) == (0, 0, 0)


PoolMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPool = PoolMachine.TestCase
