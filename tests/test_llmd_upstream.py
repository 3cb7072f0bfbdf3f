"""`llm-d` and `llm-d-legacy` as llm-d/llm-d-router runs today (read at ebab687; the priority
passthrough at its PR #2265): one hand-worked case per rule docs/simulation.md cites, on a pool
whose endpoints the test sets by hand, and the dispatch timing on a whole run."""

from __future__ import annotations

from typing import Any

import pytest

from tests.builders import make_config
from tokenpools.model.config import Config
from tokenpools.sim.baselines import PriorityShed
from tokenpools.sim.family import family_scenario
from tokenpools.sim.llmd_flow import LlmdFlowControl
from tokenpools.sim.llmd_legacy import LlmdLegacyAdmission
from tokenpools.sim.policies import POLICIES
from tokenpools.sim.policy import EndpointLoad, Queue, Refuse, Send, SimRequest, TenantLimits
from tokenpools.sim.scenario import LlmdSpec
from tokenpools.sim.simulator import Simulation

IDLE = EndpointLoad(0, 0, 16, 0.0)


class Pool:
    """A cluster set by hand: the endpoints' loads as the engines would report them now."""

    def __init__(self, *loads: EndpointLoad) -> None:
        self.loads = list(loads)
        self.serving = list(range(len(loads)))
        self.pinned: dict[str, int] = {}

    @property
    def endpoints(self) -> list[EndpointLoad]:
        return list(self.loads)

    def endpoint(self, replica: int) -> EndpointLoad:
        return self.loads[replica]

    @property
    def waiting(self) -> int:
        return sum(e.waiting for e in self.loads)

    @property
    def running(self) -> int:
        return sum(e.running for e in self.loads)

    @property
    def slots(self) -> int:
        return sum(e.slots for e in self.loads)

    @property
    def kv_usage(self) -> float:
        return sum(e.kv_usage for e in self.loads) / len(self.loads)

    def pin(self, req_id: str, replica: int) -> None:
        self.pinned[req_id] = replica


def _config() -> Config:
    return make_config(
        [
            {"name": "g", "serviceClass": "guaranteed", "concurrency": 8, "sloTargetMs": 1000},
            {"name": "s", "serviceClass": "spot"},
        ]
    )


_n = iter(range(10**6))


def _req(entitlement: str, at: float = 0.0) -> SimRequest:
    return SimRequest(f"r{next(_n)}", entitlement, entitlement, 64, 64, 64, at)


def _flow(pool: Pool, **llmd: Any) -> LlmdFlowControl:
    return LlmdFlowControl(_config(), pool, LlmdSpec(**llmd))


def _drain(policy: LlmdFlowControl, now: float) -> list[SimRequest]:
    """What the host does at an instant: ask for releases until none comes."""
    out = []
    while released := policy.dispatch(now, 0):
        out += released
    return out


# -- 1. bands: every declared objective's priority and band 0, from the start, for good ------


def test_every_declared_band_and_band_0_exist_before_any_request() -> None:
    policy = _flow(Pool(IDLE), usage_limit="priority-holdback", min_ceiling=0.4)
    assert policy.queues.order == [10, 0, -10, -20]  # model/objectives.PRIORITY's values
    # four bands by rank: 1.0, 0.8, 0.6, 0.4 — before any request came
    assert policy.ceilings(0.0) == pytest.approx([1.0, 0.8, 0.6, 0.4])
    own = _flow(Pool(IDLE), priorities={"elastic": 5, "spot": -5, "preemptible": -5})
    assert own.queues.order == [10, 5, 0, -5]  # band 0 though no class maps to it


def test_a_lone_spot_request_is_held_at_the_ceiling_of_its_rank_among_all_bands() -> None:
    # saturation max(0 / 5, 0.56 / 0.8) = 0.7: spot (band −10, rank 2 of 4) has ceiling 0.6,
    # so it waits, though no other band has ever held a request; at 0.5 it goes.
    pool = Pool(EndpointLoad(0, 4, 16, 0.56))
    policy = _flow(pool, usage_limit="priority-holdback", min_ceiling=0.4)
    assert isinstance(policy.admit(_req("s"), 0.0002), Queue)
    assert _drain(policy, 0.0002) == []
    pool.loads = [EndpointLoad(0, 4, 16, 0.4)]
    assert len(_drain(policy, 0.050)) == 1  # the next scrape shows 0.5
    assert policy.queues.order == [10, 0, -10, -20]  # all empty again, none collected


# -- 2. one release per cycle: a cycle per arrival and per 1 ms tick, none on completions -------


def test_each_cycle_releases_at_most_one_request() -> None:
    pool = Pool(EndpointLoad(5, 16, 16, 0.5))  # waiting 5 / 5: saturation 1.0
    policy = _flow(pool)
    for _ in range(3):
        policy.admit(_req("g"), 0.0003)
    assert _drain(policy, 0.0003) == []  # three arrival cycles, each blocked
    assert policy.aftermath(0.0003).wake_at == pytest.approx(0.050)  # the next scrape
    pool.loads = [IDLE]
    assert len(_drain(policy, 0.050)) == 1  # the scrape shows the room: one, on its tick
    assert policy.aftermath(0.050).wake_at == pytest.approx(0.051)
    assert _drain(policy, 0.0505) == []  # a completion between ticks runs no cycle
    assert len(_drain(policy, 0.051)) == 1
    policy.admit(_req("g"), 0.0512)
    policy.admit(_req("g"), 0.0512)
    assert len(_drain(policy, 0.0512)) == 2  # one per arrival
    assert len(policy.queues) == 1
    assert policy.aftermath(0.0512).wake_at == pytest.approx(0.052)


def test_the_soft_ceilings_tick_counts_cycles_of_arrivals_and_of_ticks() -> None:
    # saturation 0.6 / 0.8 = 0.75: spot (band 2 of 4, reflective ceiling 1 − 2 · 0.25 = 0.5)
    # alternates, open on every round(0.75 / 0.25) = 3rd cycle. The arrival's cycle is the
    # 1st (closed); the tick at 1 ms the 2nd, not run but counted; the tick at 2 ms the 3rd:
    # open. Read off the clock, it would open at 3 ms.
    policy = _flow(Pool(EndpointLoad(0, 8, 16, 0.6)), usage_limit="soft-reflective-ceiling")
    policy.admit(_req("s"), 0.0002)
    assert _drain(policy, 0.0002) == []
    assert policy.aftermath(0.0002).wake_at == pytest.approx(0.002)
    assert len(_drain(policy, 0.002)) == 1
    assert policy.soft.tick == 3


def test_releases_in_a_run_fall_on_arrivals_or_ticks_one_per_tick() -> None:
    sim = Simulation(family_scenario(3), "llm-d")
    policy = sim.policy
    assert isinstance(policy, LlmdFlowControl)
    dispatch, arrivals = policy.dispatch, set()
    releases: dict[float, int] = {}
    admit = policy.admit

    def admitted(req: SimRequest, now: float) -> Any:
        arrivals.add(now)
        return admit(req, now)

    def counted(now: float, free: int) -> list[SimRequest]:
        out = dispatch(now, free)
        releases[now] = releases.get(now, 0) + len(out)
        return out

    policy.admit = admitted  # type: ignore[method-assign]
    policy.dispatch = counted  # type: ignore[method-assign]
    sim.run()
    on_ticks = {t: n for t, n in releases.items() if n and t not in arrivals}
    assert on_ticks and sum(on_ticks.values()) > 100
    assert all(abs(t * 1000 - round(t * 1000)) < 1e-6 for t in on_ticks)  # 1 ms ticks
    assert max(on_ticks.values()) == 1


# -- 3. the confirmation grace follows the detector ----------------------------------------------


def test_the_confirmation_grace_is_derived_from_the_detector() -> None:
    # concurrency: evictionLeadingSensorGrace 10 ms; utilisation: refresh 50 ms + the server's
    # metrics staleness threshold 2 s + engine reclaim 250 ms
    assert _flow(Pool(IDLE), detector="concurrency").grace_s == pytest.approx(0.010)
    assert _flow(Pool(IDLE)).grace_s == pytest.approx(2.300)
    assert _flow(Pool(IDLE), confirmation_grace_s=0.5).grace_s == 0.5


def test_the_next_revocations_wait_for_the_grace() -> None:
    # concurrency detector, 16 per endpoint: 16 spot in flight is saturation 1.0, and a
    # guaranteed request waits; two revocations, then none until 10 ms later.
    pool = Pool(IDLE)
    policy = _flow(pool, detector="concurrency", max_concurrency=16)
    for _ in range(16):
        policy.admit(_req("s"), 0.0001)
        _drain(policy, 0.0001)
    pool.loads = [EndpointLoad(0, 16, 16, 0.5)]
    policy.admit(_req("g"), 0.0004)
    assert _drain(policy, 0.0004) == []
    first = policy.aftermath(0.0004)
    assert len(first.evict) == 1  # deficit 1.0 − 1.0 = 0: at least one
    assert first.wake_at == pytest.approx(0.011)  # the first tick at or after 10.4 ms
    policy.admit(_req("g"), 0.008)
    _drain(policy, 0.008)
    assert policy.aftermath(0.008).evict == []
    assert _drain(policy, 0.011) == []
    assert len(policy.aftermath(0.011).evict) == 1


# -- 4. the utilisation detector and the picker read each endpoint's last scrape -------------


def test_the_utilisation_detector_reads_the_last_scrape_not_the_engines_now() -> None:
    pool = Pool(IDLE)
    policy = _flow(pool)
    policy.admit(_req("g"), 0.001)
    assert len(_drain(policy, 0.001)) == 1  # scraped idle at 1 ms
    pool.loads = [EndpointLoad(10, 16, 16, 0.9)]  # saturation 2.0 from 20 ms on
    policy.admit(_req("g"), 0.020)
    assert len(_drain(policy, 0.020)) == 1  # the scrape still says idle
    policy.admit(_req("g"), 0.050)
    assert _drain(policy, 0.050) == []  # the next one does not
    # the concurrency detector reads llm-d's own counters: at once
    live = _flow(pool, detector="concurrency")
    live.admit(_req("g"), 0.020)
    assert _drain(live, 0.020) == []


def test_each_endpoint_is_scraped_on_its_own_timer_their_phases_spread() -> None:
    # two endpoints from the start: scraped at ticks 0 and 25 (mod 50), llm-d's one ticker per
    # endpoint (datalayer/runtime.go); a read between their scrapes sees one fresh, one stale
    busy = EndpointLoad(5, 16, 16, 0.5)  # roofline 1.0
    pool = Pool(IDLE, IDLE)
    policy = _flow(pool)
    first = _req("g")
    policy.admit(first, 0.001)
    assert len(_drain(policy, 0.001)) == 1  # both read idle at 1 ms
    assert pool.pinned[first.req_id] == 0
    assert policy.aftermath(0.001).wake_at == pytest.approx(0.025)  # endpoint 1's scrape
    pool.loads = [busy, busy]
    assert policy.scrape.read(0.010) == [IDLE, IDLE]  # neither scraped since
    _drain(policy, 0.025)
    assert policy.scrape.read(0.030) == [IDLE, busy]  # endpoint 1 fresh, endpoint 0 stale
    second = _req("g")
    policy.admit(second, 0.030)
    assert len(_drain(policy, 0.030)) == 1  # saturation (0 + 1.0) / 2 = 0.5
    assert pool.pinned[second.req_id] == 0  # the picker, too, reads endpoint 0 as idle
    assert policy.aftermath(0.030).wake_at == pytest.approx(0.050)  # endpoint 0's scrape
    policy.admit(_req("g"), 0.050)
    assert _drain(policy, 0.050) == []  # both busy now: 1.0
    # an endpoint that joins is read when first seen and every 50 ms from then
    pool.loads.append(IDLE)
    pool.serving = [0, 1, 2]
    assert policy.scrape.read(0.0613) == [busy, busy, IDLE]
    pool.loads[2] = busy
    assert policy.scrape.next_window(0.070) == 75  # endpoint 1's; endpoint 2's is tick 111
    assert policy.scrape.read(0.110)[2] == IDLE
    assert policy.scrape.read(0.111)[2] == busy


def test_the_picker_sends_to_the_least_loaded_endpoint_of_the_scrape() -> None:
    pool = Pool(EndpointLoad(2, 8, 16, 0.3), EndpointLoad(0, 4, 16, 0.2))
    policy = _flow(pool)
    first = _req("g")
    policy.admit(first, 0.001)
    _drain(policy, 0.001)
    assert pool.pinned[first.req_id] == 1  # 4 in flight against 10
    pool.loads.reverse()  # now endpoint 0 is the lighter, but the scrape says otherwise
    second = _req("g")
    policy.admit(second, 0.010)
    _drain(policy, 0.010)
    assert pool.pinned[second.req_id] == 1
    # equally loaded endpoints take turns
    even = Pool(IDLE, IDLE)
    legacy = LlmdLegacyAdmission(_config(), even)
    picks = []
    for _ in range(4):
        req = _req("g")
        legacy.admit(req, 0.0)
        picks.append(even.pinned[req.req_id])
    assert picks == [0, 1, 0, 1]


# -- 5. priority passthrough -------------------------------------------------------------------


@pytest.mark.parametrize("on", [True, False])
def test_the_router_writes_the_negated_band_into_the_request_when_asked(on: bool) -> None:
    policy = _flow(Pool(IDLE), propagate_priority=on)
    legacy = LlmdLegacyAdmission(_config(), Pool(IDLE), LlmdSpec(propagate_priority=on))
    guaranteed, spot, direct = _req("g"), _req("s"), _req("s")
    policy.admit(guaranteed, 0.001)
    policy.admit(spot, 0.001)
    assert _drain(policy, 0.001) == [guaranteed, spot]
    assert isinstance(legacy.admit(direct, 0.001), Send)
    # vLLM serves the lower value first: guaranteed's band 10 is −10, spot's −10 is 10
    assert (guaranteed.priority, spot.priority, direct.priority) == (
        (-10, 10, 10) if on else (0, 0, 0)
    )
    assert LlmdSpec().propagate_priority is False  # upstream's propagatePriority: off


# -- 7. the legacy admission: no queue, sheddable refused at saturation 1 ----------------------


@pytest.mark.parametrize(
    ("load", "spot_refused"),
    [
        (EndpointLoad(5, 16, 16, 0.2), True),  # 5 / 5 = 1.0
        (EndpointLoad(0, 16, 16, 0.8), True),  # 0.8 / 0.8 = 1.0
        (EndpointLoad(4, 16, 16, 0.7), False),  # max(0.8, 0.875) < 1
    ],
)
def test_legacy_refuses_sheddable_requests_only_at_saturation_one(
    load: EndpointLoad, spot_refused: bool
) -> None:
    policy = LlmdLegacyAdmission(_config(), Pool(load))
    verdict = policy.admit(_req("s"), 0.0)
    assert isinstance(verdict, Refuse) == spot_refused
    assert isinstance(policy.admit(_req("g"), 0.0), Send)  # priority ≥ 0: never refused
    assert "llm-d-legacy" in POLICIES


# -- 8. priority-shed: the per-endpoint average ---------------------------------------------------


def test_priority_shed_reads_the_average_of_each_endpoints_saturation() -> None:
    limits = {"s": TenantLimits(60, 6000, 4, sheddable=True)}
    # endpoint 0: max(4 / 5, 0.2 / 0.8) = 0.8; endpoint 1: max(0, 0.96 / 0.8) = 1.2 → 1.0: shed,
    # though the pool's 4 waiting and 0.58 mean KV are both under the thresholds
    hot = Pool(EndpointLoad(4, 16, 16, 0.2), EndpointLoad(0, 16, 16, 0.96))
    assert isinstance(PriorityShed(limits, hot).admit(_req("s"), 0.0), Refuse)
    # endpoint 0: 8 / 5 = 1.6; endpoint 1 idle → 0.8: admitted, though 8 wait in the pool
    uneven = Pool(EndpointLoad(8, 16, 16, 0.5), IDLE)
    assert isinstance(PriorityShed(limits, uneven).admit(_req("s"), 0.0), Send)
