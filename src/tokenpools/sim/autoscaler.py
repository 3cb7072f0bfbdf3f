"""The pool's autoscaler in the simulator: the policy's own arithmetic (for tokenpools, the
decision core's desired replicas — the code the operator runs) acted on with a cold start.

When to act is the core's `Hysteresis`: a replica is asked for once the need has stayed above
what is provisioned for `scale_up_delay_s`; it costs replica-seconds from that moment and serves
`cold_start_s` later (a GPU node loading the model). One replica is drained once the need has
stayed below the serving count for `scale_down_delay_s`: it takes no new requests and is
released when its last request ends.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenpools.control.autoscale import Hysteresis
from tokenpools.sim.policy import AdmissionPolicy
from tokenpools.sim.replicas import Replicas
from tokenpools.sim.scenario import AutoscalingSpec
from tokenpools.sim.timeline import Timeline


class Autoscaler:
    def __init__(
        self,
        spec: AutoscalingSpec,
        *,
        bounds: tuple[int, int],  # the pool's fewest and most replicas
        timeline: Timeline,
        replicas: Replicas,
        policy: AdmissionPolicy,
        changed: Callable[[], None],  # the serving replicas changed: the policy is told
    ) -> None:
        self.spec = spec
        self.lo, self.hi = bounds
        self.timeline, self.replicas, self.policy = timeline, replicas, policy
        self.changed = changed
        self.starting = 0  # replicas asked for, still in their cold start
        self.rule = Hysteresis(spec.scale_up_delay_s, spec.scale_down_delay_s)
        # (time, "ask" | "serve" | "drain"): what the autoscaler did, for reports and tests
        self.log: list[tuple[float, str]] = []

    def start(self) -> None:
        self.timeline.at(0.0, self._check)

    def _check(self) -> None:
        now = self.timeline.now
        desired = self.policy.desired_replicas(now)
        if desired is not None:
            desired = max(self.lo, min(self.hi, desired))
            serving = len(self.replicas.serving)
            act = self.rule.step(serving + self.starting, serving, desired, now)
            for _ in range(act):
                self.starting += 1
                self.log.append((now, "ask"))
                self.replicas.ask(now)
                self.timeline.at(now + self.spec.cold_start_s, self._ready)
            if act < 0:
                self._drain_one()
        self.timeline.at(now + self.spec.interval_s, self._check)

    def _ready(self) -> None:
        """A new replica starts serving: its cold start is over."""
        self.starting -= 1
        self.log.append((self.timeline.now, "serve"))
        self.replicas.add()
        self.changed()

    def _drain_one(self) -> None:
        """The least busy serving replica stops taking requests; released when empty."""
        replicas = self.replicas
        serving = replicas.serving
        if len(serving) <= 1:
            return
        index = min(serving, key=lambda i: (replicas.engines[i].num_running, -i))
        replicas.drain(index)
        self.log.append((self.timeline.now, "drain"))
        self.changed()
        replicas.release_if_idle(index, self.timeline.now)
