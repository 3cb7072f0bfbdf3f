"""tokenpools as a simulator policy: the decision core itself, on its memory store, driven
through the same admission pipeline the hosts run (sim/policy.py is the interface)."""

from __future__ import annotations

from dataclasses import replace

from tokenpools.control.core import DecisionCore
from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.tenancy import Directory
from tokenpools.model.config import Config
from tokenpools.model.objectives import carried_priority
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.model.resources import Resources
from tokenpools.sim.policy import (
    AdmissionPolicy,
    Refuse,
    Send,
    SimRequest,
    Verdict,
)
from tokenpools.state.memory import MemoryStore


class TokenPools(AdmissionPolicy):
    """The decision core itself, called exactly as the gateway calls it."""

    name = "tokenpools"
    host_suspends = True  # this host suspends what the core takes back (sim/suspension.py)

    def __init__(
        self,
        config: Config,
        now: float,
        absent: frozenset[str] = frozenset(),
        layered: frozenset[str] = frozenset(),
    ) -> None:
        """`layered`: entitlements whose requests go to all of their tenant's entitlements in
        the pool, in layer order (control/layers.py), as the gateway sends a tenant's."""
        self.config = config
        directory = Directory(config)
        self.layers: dict[str, tuple[str, ...]] = {}
        for name in layered:
            ent = config.entitlements[name]
            self.layers[name] = directory.layers(ent.tenant_id)[ent.pool]
        self.absent = set(absent)  # entitlements not created yet
        self.suspends = config.policy.suspend and self.host_suspends
        self.store = MemoryStore()
        self.core = DecisionCore(self._current(), self.store, now=now, suspends=self.host_suspends)
        self.pool = next(iter(config.pools))
        self.per_replica = config.pools[self.pool].per_replica
        self.scheduling = config.pools[self.pool].scheduling_policy
        self.replicas = config.pools[self.pool].replicas
        self.capacity_now = self.per_replica  # after capacity events
        self.tenant_of: dict[str, str] = {}  # entitlement → tenant
        # With budgets in the config, requests are charged to them as the gateway charges a
        # tenant's (its key: `sim`, the model: the pool); without, nothing is metered.
        self.accounts = (
            {n: Account(e.tenant_id, "sim", e.pool) for n, e in config.entitlements.items()}
            if config.budgets
            else {}
        )

    def _current(self) -> Config:
        ents = {k: v for k, v in self.config.entitlements.items() if k not in self.absent}
        return replace(self.config, entitlements=ents)

    def join(self, entitlement: str, now: float) -> None:
        self.absent.discard(entitlement)
        self.core.apply_config(self._current(), now)

    def leave(self, entitlement: str, now: float) -> list[str]:
        # Leaving = the entitlement expires now: it stops admitting and stops holding its
        # baseline back at once, while its requests in flight finish and settle normally.
        ent = replace(self.config.entitlements[entitlement], expires_at=now)
        self.config = replace(
            self.config, entitlements=self.config.entitlements | {entitlement: ent}
        )
        return [lease.lease_id for lease in self.core.apply_config(self._current(), now)]

    def admit(self, req: SimRequest, now: float) -> Verdict:
        decision = self.decide(req, now)
        if isinstance(decision, Admit):
            req.within = decision.lease.reserved_path
            charged = self.config.entitlements[decision.lease.entitlement]
            carried = carried_priority(self.scheduling, charged.service_class)
            if carried is not None:  # what the gateway writes into the body
                req.priority = carried
            return Send([lease.lease_id for lease in decision.evict])
        # a refused request says whether it asked within its baseline, as an admitted one does
        req.within = self.core.within_baseline(req.entitlement, now)
        return Refuse(decision.reason.value, decision.retry_after_s)

    def decide(self, req: SimRequest, now: float) -> Decision:
        """The core's decision on one attempt, through the admission pipeline."""
        self.tenant_of[req.entitlement] = req.tenant
        cost = RequestCost(req.prompt_tokens, req.max_tokens, 1, self.accounts.get(req.entitlement))
        names = self.layers.get(req.entitlement, (req.entitlement,))
        return self.core.admit(names, cost, now, req.req_id)

    def suspend_deadline_s(self, req: SimRequest) -> float:
        cls = self.config.entitlements[req.entitlement].service_class
        return self.config.policy.suspend_deadline_s[cls]

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        # a continuation's prompt was counted with the request it continues
        prompt = 0 if req.continues else req.prompt_tokens
        self.core.settle(req.req_id, Usage(prompt, output_tokens), now)

    def ended_early(self, req: SimRequest, now: float) -> None:
        self.core.release(req.req_id, now, refund=False)

    def tick(self, now: float) -> list[str]:
        result = self.core.tick(now)
        return [lease.lease_id for lease in result.expired]

    def capacity(self, fraction: float, throughput_fraction: float, now: float) -> list[str]:
        base = self.per_replica
        per_replica = Resources(
            base.throughput * throughput_fraction,
            base.kv_tokens * fraction,
            base.concurrency * fraction,
        )
        self.capacity_now = per_replica
        change = self.core.set_capacity(self.pool, now, per_replica=per_replica)
        return [lease.lease_id for lease in change.evict]

    def desired_replicas(self, now: float) -> int | None:
        return self.core.desired_replicas(self.pool)

    def set_replicas(self, replicas: int, now: float) -> list[str]:
        self.replicas = replicas
        change = self.core.set_replicas(self.pool, replicas, now)
        return [lease.lease_id for lease in change.evict]

    def restart(self, now: float, store_kept: bool = False) -> None:
        # A new core, told the capacity the old one had been told, on the old store if it is
        # kept; on a new one, the requests in flight settle as unknown leases (a no-op).
        self.store = self.store if store_kept else MemoryStore()
        self.core = DecisionCore(self._current(), self.store, now=now, suspends=self.host_suspends)
        if self.capacity_now != self.per_replica:
            self.core.set_capacity(self.pool, now, per_replica=self.capacity_now)
        if self.replicas != self.config.pools[self.pool].replicas:
            self.core.set_replicas(self.pool, self.replicas, now)

    def scores(self, now: float) -> dict[str, tuple[float, float]]:
        out = {}
        for ent, tenant in self.tenant_of.items():
            if ent in self.absent:
                continue
            scores = self.core.scores(ent, now)
            out[tenant] = (scores.debt, scores.priority)
        return out
