"""tokenpools in front of llm-d's flow control (`tokenpools+llm-d`), as the ext_proc deployment
runs them: the decision core admits or refuses each request (429 with Retry-After) and names its
band — the InferenceObjective of the admitting entitlement's class — and its fairness id, the
tenant; llm-d queues what was admitted, dispatches it by band and fairness, times it out and
evicts sheddable requests in flight. Whatever ends a request, on either side, ends its lease."""

from __future__ import annotations

from tokenpools.control.decisions import Admit
from tokenpools.model.config import Config
from tokenpools.sim.llmd_flow import LlmdFlowControl, band_priorities
from tokenpools.sim.policy import Aftermath, Cluster, Queue, Refuse, SimRequest, Verdict
from tokenpools.sim.scenario import LlmdSpec
from tokenpools.sim.tokenpools_policy import TokenPools


class TokenPoolsThenLlmd(TokenPools):
    name = "tokenpools+llm-d"
    holds_requests = True
    host_suspends = False  # what it takes back leaves llm-d's queue or engine: ended

    def __init__(
        self,
        config: Config,
        now: float,
        cluster: Cluster,
        spec: LlmdSpec | None = None,
        absent: frozenset[str] = frozenset(),
        layered: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(config, now, absent, layered)
        self.flow = LlmdFlowControl(config, cluster, spec)
        self.bands = band_priorities(self.flow.spec)
        self.requests: dict[str, SimRequest] = {}  # admitted and not ended, by request id

    def admit(self, req: SimRequest, now: float) -> Verdict:
        decision = self.decide(req, now)
        if not isinstance(decision, Admit):
            return Refuse(decision.reason.value, decision.retry_after_s)
        ent = self.config.entitlements[decision.lease.entitlement]
        refused = self.flow.enqueue(req, self.bands[ent.service_class], ent.tenant_id, now)
        if refused is not None:  # llm-d's band is full: the lease ends unused
            super().ended_early(req, now)
            return refused
        self.requests[req.req_id] = req
        return Queue([lease.lease_id for lease in decision.evict])

    def dispatch(self, now: float, free_slots: int) -> list[SimRequest]:
        return self.flow.dispatch(now, free_slots)

    def finished(self, req: SimRequest, output_tokens: int, now: float) -> None:
        self.requests.pop(req.req_id, None)
        self.flow.finished(req, output_tokens, now)
        super().finished(req, output_tokens, now)

    def ended_early(self, req: SimRequest, now: float) -> None:
        """Evicted by either side (tokenpools' victims may still wait in llm-d's queue)."""
        if self.requests.pop(req.req_id, None) is not None:
            self.flow.ended_early(req, now)
            super().ended_early(req, now)

    def tick(self, now: float) -> list[str]:
        expired = super().tick(now)
        self.flow.tick(now)
        return expired

    def aftermath(self, now: float) -> Aftermath:
        """llm-d's time-outs and evictions; a timed-out request's lease ends here (no engine
        ran it), an evicted one's when the host ends it (`ended_early`)."""
        out = self.flow.aftermath(now)
        for req_id, _ in out.refuse:
            req = self.requests.pop(req_id, None)
            if req is not None:
                super().ended_early(req, now)
        return out
