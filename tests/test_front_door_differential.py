"""The simulator and the gateway admit alike: generated traces of requests (chat and
embeddings, a tenant with layers, budgets that lower max_tokens, surplus work leaving the
others' claims free, settlements and update periods) go through the simulator's policy and
through the runtime's front door (`AdmissionRuntime.clear`, as every host calls it), on the
memory store and on Redis; the two decide identically, request by request: admitted or not,
the reason, the layer charged, the tokens reserved (a lowered max_tokens shows there) and who
was evicted."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenpools.admission import AdmissionRuntime, Cleared, FrontDoor
from tokenpools.admission.jobs import PeriodicJobs
from tokenpools.control.tenancy import Caller
from tokenpools.model.config import Config, parse_config
from tokenpools.model.request import Usage
from tokenpools.openai_api import CHAT, EMBEDDINGS
from tokenpools.sim.policies import TokenPools
from tokenpools.sim.policy import Refuse, Send, SimRequest

MODEL = "m"
TENANTS = ("acme", "bolt", "crow")


def config_data(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "state": state,
        # leases outlive the trace: the gateway renews its leases, the simulator has no need to;
        # the simulator suspends what is taken back, the gateway ends it: both as the gateway
        "policy": {"retryAfterMinS": 1, "backfillWindowS": 40, "leaseTtlS": 3600,
                   "suspend": False},
        "pools": [
            {"name": "p", "model": "Qwen3-8B", "servedModels": [MODEL], "replicas": 1,
             "perReplica": {"tokensPerSecond": 4000, "kvTokens": 20000, "concurrency": 8}},
        ],
        "entitlements": [
            # acme's layers: guaranteed first, then spot beyond it
            {"name": "acme-gold", "tenantId": "acme", "pool": "p", "serviceClass": "guaranteed",
             "sloTargetMs": 1000, "concurrency": 2},
            {"name": "acme-spot", "tenantId": "acme", "pool": "p", "serviceClass": "spot"},
            {"name": "bolt", "tenantId": "bolt", "pool": "p", "serviceClass": "elastic",
             "sloTargetMs": 3000, "concurrency": 3},
            {"name": "crow", "tenantId": "crow", "pool": "p", "serviceClass": "preemptible"},
        ],
        "budgets": [
            {"name": "acme-day", "tenant": "acme", "limit": 3000, "window": "day",
             "lowerMaxTokens": True},
            {"name": "bolt-life", "entitlement": "bolt", "limit": 4000, "lowerMaxTokens": True},
        ],
    }  # fmt: skip


@dataclass(frozen=True)
class Ask:
    tenant: str
    embeddings: bool
    words: int  # of the prompt
    max_tokens: int
    output: int  # what the engine generates, if admitted


@dataclass(frozen=True)
class Settle:
    index: int  # of the admitted requests still in flight, modulo their number


@dataclass(frozen=True)
class Tick:
    pass


EVENTS = st.one_of(
    st.builds(
        Ask,
        st.sampled_from(TENANTS),
        st.booleans(),
        st.integers(1, 300),
        st.integers(1, 900),
        st.integers(0, 900),
    ),
    st.builds(Settle, st.integers(0, 50)),
    st.just(Tick()),
)
TRACES = st.lists(st.tuples(st.floats(0.01, 2.0), EVENTS), min_size=5, max_size=60)


def _drawn(seed: int, length: int = 60) -> list[tuple[float, object]]:
    """A trace drawn as TRACES draws one, from a seed."""
    rng = random.Random(seed)
    trace: list[tuple[float, object]] = []
    for _ in range(length):
        kind = rng.random()
        event: object
        if kind < 0.6:
            event = Ask(
                rng.choice(TENANTS),
                rng.random() < 0.5,
                rng.randint(1, 300),
                rng.randint(1, 900),
                rng.randint(0, 900),
            )
        elif kind < 0.9:
            event = Settle(rng.randint(0, 50))
        else:
            event = Tick()
        trace.append((rng.uniform(0.01, 2.0), event))
    return trace


def body_of(ask: Ask) -> tuple[str, dict[str, Any]]:
    text = " ".join(["word"] * ask.words)
    if ask.embeddings:
        return EMBEDDINGS, {"model": MODEL, "input": text}
    content = [{"role": "user", "content": text}]
    return CHAT, {"model": MODEL, "messages": content, "max_tokens": ask.max_tokens}


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def replay(
    config: Config, trace: list[tuple[float, object]]
) -> tuple[list[tuple[Any, ...]], int]:
    """Each request's decision through both paths, side by side (fails at the first that
    differs), and how many were admitted with max_tokens lowered to fit a budget."""
    clock = Clock()
    runtime = AdmissionRuntime(config, clock=clock, replica="gw")
    door = FrontDoor(runtime, clock=clock)
    jobs = PeriodicJobs(runtime)
    await runtime.driver.start()
    sim = TokenPools(config, clock.now, layered=frozenset({"acme-gold", "acme-spot"}))
    sim_ids: dict[str, int] = {}  # the simulator's request id → request number
    gw_ids: dict[str, int] = {}  # the gateway's lease id → request number
    flying: list[tuple[int, Any, SimRequest, int]] = []  # number, admitted, sim request, output
    seen = []
    lowered = 0
    try:
        for number, (gap, event) in enumerate(trace):
            clock.now += gap
            now = clock.now
            if isinstance(event, Tick):
                sim.tick(now)
                await jobs.tick()
            elif isinstance(event, Settle):
                if flying:
                    _, admitted, req, output = flying.pop(event.index % len(flying))
                    sim.finished(req, output, now)
                    admitted.end(_usage(req, output))
                    # on a shared store the end is a task of its own: the next decision is
                    # compared with the simulator's once it has reached the store
                    await runtime.driver.ends_done()
            else:
                assert isinstance(event, Ask)
                path, body = body_of(event)
                caller = Caller(event.tenant, "key")
                raw = json.dumps(body).encode()  # as a host hands it in
                result = await door.enter(None, caller, path, raw, task=None)
                prompt = result.prompt_tokens
                assert prompt is not None
                entitlement = "acme-gold" if event.tenant == "acme" else event.tenant
                asked = 0 if event.embeddings else event.max_tokens
                req = SimRequest(f"s{number}", event.tenant, entitlement, prompt, 0, asked, now)
                verdict = sim.admit(req, now)
                if isinstance(result, Cleared):
                    lease = result.decision.lease
                    gw_ids[lease.lease_id] = number
                    evicted = sorted(gw_ids[v.lease_id] for v in result.decision.evict)
                    gw = ("admitted", lease.entitlement, lease.tokens, evicted)
                    admitted = result.admitted
                    lowered += result.decision.lowered
                    flying.append((number, admitted, req, min(event.output, asked)))
                else:
                    assert result.decision is not None
                    gw = ("refused", result.decision.reason.value)
                if isinstance(verdict, Send):
                    sim_ids[req.req_id] = number
                    held = sim.core.store.get_lease(req.req_id, now)
                    assert held is not None
                    evicted = sorted(sim_ids[v] for v in verdict.evict)
                    mine = ("admitted", held.entitlement, held.tokens, evicted)
                else:
                    assert isinstance(verdict, Refuse)
                    mine = ("refused", verdict.reason)
                assert gw == mine, f"request {number} ({event}): gateway {gw}, simulator {mine}"
                seen.append(gw)
                for victim in gw[3] if gw[0] == "admitted" else []:
                    flying[:] = [f for f in flying if f[0] != victim]
    finally:
        await runtime.driver.aclose()
    return seen, lowered


def _usage(req: SimRequest, output: int) -> Usage:
    return Usage(req.prompt_tokens, output)


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    if request.param == "memory":
        yield {"backend": "memory"}
        return
    url = request.getfixturevalue("redis_url")
    client = redis.Redis.from_url(url)
    yield {"backend": "redis", "url": url}
    client.flushall()
    client.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(trace=TRACES)
def test_the_simulator_and_the_front_door_decide_alike(
    state: dict[str, Any], trace: list[tuple[float, object]]
) -> None:
    if state["backend"] == "redis":
        redis.Redis.from_url(state["url"]).flushall()
    seen, _ = asyncio.run(replay(parse_config(config_data(state)), trace))
    assert len(seen) == sum(isinstance(e, Ask) for _, e in trace)


def test_the_generated_traces_reach_every_rule_compared() -> None:
    """Traces drawn as the test above draws them, pooled: layers charged past the first, a
    budget refusal, a max_tokens lowered to fit a budget, an eviction, a refusal for room."""
    seen: list[tuple[Any, ...]] = []
    lowered = 0
    for seed in range(12):
        trace = _drawn(seed)
        got, n = asyncio.run(replay(parse_config(config_data({"backend": "memory"})), trace))
        seen += got
        lowered += n
    admitted = [s for s in seen if s[0] == "admitted"]
    assert {s[1] for s in admitted} >= {"acme-gold", "acme-spot", "bolt", "crow"}
    reasons = {s[1] for s in seen if s[0] == "refused"}
    assert "insufficient_quota" in reasons and reasons - {"insufficient_quota"}
    assert any(s[3] for s in admitted), "no admission evicted anyone"
    assert lowered > 0
