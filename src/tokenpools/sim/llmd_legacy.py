"""llm-d's legacy admission as a simulator policy (`llm-d-legacy`): what llm-d's endpoint
picker does with its `flowControl` feature gate off, which is its default. Nothing waits in the
picker: a sheddable request (priority < 0) is refused while the pool's saturation, as the
configured detector reads it, is at least 1.0 (429, no Retry-After); every other request goes to
the endpoint the picker chooses at once (pkg/epp/requestcontrol/admission.go,
LegacyAdmissionController; cmd/epp/runner/runner.go wires it when the gate is off).
"""

from __future__ import annotations

from tokenpools.model.config import Config
from tokenpools.sim.llmd_flow import band_priorities
from tokenpools.sim.llmd_scrape import Scrape
from tokenpools.sim.policy import AdmissionPolicy, Cluster, Refuse, Send, SimRequest, Verdict
from tokenpools.sim.scenario import LlmdSpec


class LlmdLegacyAdmission(AdmissionPolicy):
    name = "llm-d-legacy"

    def __init__(self, config: Config, cluster: Cluster, spec: LlmdSpec | None = None) -> None:
        self.spec = spec or LlmdSpec()
        classes = band_priorities(self.spec)
        self.band_of = {n: classes[e.service_class] for n, e in config.entitlements.items()}
        self.scrape = Scrape(cluster, self.spec)

    def admit(self, req: SimRequest, now: float) -> Verdict:
        priority = self.band_of[req.entitlement]
        if priority < 0 and self.scrape.saturation(now) >= 1.0:
            return Refuse("shed")  # "system saturated, sheddable request dropped"
        self.scrape.pick(req, now)
        if self.spec.propagate_priority:  # vLLM serves lower values first
            req.priority = -priority
        return Send()
