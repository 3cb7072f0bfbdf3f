"""The pool's autoscaler in the simulator: the policy's own arithmetic (for tokenpools, the
decision core's desired replicas — the code the operator runs) acted on with a cold start.

When to act is the core's `Hysteresis`: a replica is asked for once the need has stayed above
what is provisioned for `scale_up_delay_s`; it costs replica-seconds from that moment and serves
`cold_start_s` later (a GPU node loading the model). One replica is drained once the need has
stayed below the serving count for `scale_down_delay_s`: it takes no new requests and is
released when its last request ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenpools.control.autoscale import Hysteresis
from tokenpools.engine.model import Engine
from tokenpools.sim.scenario import AutoscalingSpec

if TYPE_CHECKING:
    from tokenpools.sim.simulator import Simulation


class ReplicaMeter:
    """Replica-seconds: the integral of replicas provisioned (serving, starting or
    draining) over time, and the largest count."""

    def __init__(self, replicas: int, now: float) -> None:
        self.provisioned = self.peak = replicas
        self.seconds = 0.0
        self._t = now

    def change(self, delta: int, now: float) -> None:
        self.advance(now)
        self.provisioned += delta
        self.peak = max(self.peak, self.provisioned)

    def advance(self, now: float) -> None:
        self.seconds += self.provisioned * (now - self._t)
        self._t = now


class Autoscaler:
    def __init__(self, spec: AutoscalingSpec, sim: Simulation, lo: int, hi: int) -> None:
        self.spec, self.sim, self.lo, self.hi = spec, sim, lo, hi
        self.starting = 0
        self.rule = Hysteresis(spec.scale_up_delay_s, spec.scale_down_delay_s)
        # (time, "ask" | "serve" | "drain"): what the autoscaler did, for reports and tests
        self.log = sim.scaling

    def start(self) -> None:
        self.sim.at(0.0, self._check)

    def _check(self) -> None:
        sim, now = self.sim, self.sim.now
        desired = sim.policy.desired_replicas(now)
        if desired is not None:
            desired = max(self.lo, min(self.hi, desired))
            serving = len(sim.serving)
            act = self.rule.step(serving + self.starting, serving, desired, now)
            for _ in range(act):
                self.starting += 1
                self.log.append((now, "ask"))
                sim.meter.change(+1, now)
                sim.at(now + self.spec.cold_start_s, self._ready)
            if act < 0:
                self._drain_one()
        sim.at(now + self.spec.interval_s, self._check)

    def _ready(self) -> None:
        """A new replica starts serving: its cold start is over."""
        self.starting -= 1
        sim = self.sim
        self.log.append((sim.now, "serve"))
        engine = Engine(sim.profile)
        if sim.fraction != 1.0:
            engine.resize(*sim.profile.limits_at(sim.fraction))
        sim.engines.append(engine)
        sim.busy.append(False)
        sim.replicas_changed()

    def _drain_one(self) -> None:
        """The least busy serving replica stops taking requests; released when empty."""
        sim = self.sim
        serving = sim.serving
        if len(serving) <= 1:
            return
        index = min(serving, key=lambda i: (sim.engines[i].num_running, -i))
        sim.draining.add(index)
        self.log.append((sim.now, "drain"))
        sim.replicas_changed()
        if not sim.busy[index] and not sim.engines[index].has_work:
            sim.release(index)
