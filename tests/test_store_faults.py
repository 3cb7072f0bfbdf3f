"""A booked admission always ends, whatever happens between the store and its caller.

The gateway's runtime (`Gateway`: the core, its store, ticks, hand-over, the owed lease ends)
serves closed-loop clients of four classes, the way the HTTP handler does (admit, hold the
request, end it; a cancelled client's request ends too), while hypothesis draws a schedule of
faults: a loopback TCP proxy between the gateway and Redis that delays, pauses or cuts the
connection; SIGSTOP/SIGCONT of the redis-server (the master, behind Sentinel or in a Cluster);
the gateway's event loop blocked by a slow callback; clients that disconnect at once. Once the
clients are done, every pool's and entitlement's in-flight, KV and lease counters are back to 0
within two update periods, with the lease TTL at its default (600 s: nothing is left to expire),
and no counter is ever negative (sampled every 20 ms by a client of the test's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faults import FaultProxy, fault_proxy, sigcont, sigstop, stall
from tests.ledger_reads import negative, nonzero, redis_counters
from tokenpools.control.decisions import Admit, Reason
from tokenpools.gateway.runtime import AdmittedRequest, Gateway
from tokenpools.model.config import Config, parse_config
from tokenpools.model.request import RequestCost, Usage
from tokenpools.processes import redis_server
from tokenpools.redis_topologies import redis_cluster, redis_sentinel

PERIOD_S = 0.5  # the update period
TICK_S = 0.05
TIMEOUT_MS = 50
ENTS = ("gold", "elastic", "spot", "batch")
GOLD_BASELINE = 4


def fault_config(
    url: str | None, prefix: str, fallback: float = 0.5, timeout_ms: float = TIMEOUT_MS
) -> Config:
    state: dict[str, Any] = {"backend": "memory"}
    if url is not None:
        state = {"backend": "redis", "url": url, "keyPrefix": prefix, "timeoutMs": timeout_ms,
                 "fallbackFraction": fallback}  # fmt: skip
    return parse_config(
        {
            "policy": {"updatePeriodS": PERIOD_S},  # leaseTtlS: its default, 600 s
            "state": state,
            "pools": [
                {
                    "name": "p",
                    "model": "Qwen3-8B",
                    "servedModels": ["m"],
                    "backends": [{"url": "http://127.0.0.1:9"}],  # never called here
                    "perReplica": {"tokensPerSecond": 1e6, "kvTokens": 65536, "concurrency": 16},
                }
            ],
            "entitlements": entitlements(),
        }
    )


def entitlements() -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = [
        {"name": "gold", "serviceClass": "guaranteed", "sloTargetMs": 1000,
         "concurrency": GOLD_BASELINE},
        {"name": "elastic", "serviceClass": "elastic", "sloTargetMs": 2000, "concurrency": 2,
         "burst": {"concurrency": 6}},
        {"name": "spot", "serviceClass": "spot"},
        {"name": "batch", "serviceClass": "preemptible"},
    ]  # fmt: skip
    return [{"tenantId": s["name"], "pool": "p", **s} for s in specs]


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    for_s: float


@dataclass
class Answer:
    entitlement: str
    sent: float
    decided: float
    reason: str | None  # None: admitted


@dataclass
class Run:
    answers: list[Answer] = field(default_factory=list)
    negative: list[str] = field(default_factory=list)
    settled_in_s: float = float("inf")
    left: list[str] = field(default_factory=list)


@dataclass
class Topology:
    """Where the ledger lives, how the test reads it, and the faults it can inject."""

    url: str | None
    read: Callable[[str], dict[str, dict[str, float]]]  # by key prefix
    inject: dict[str, Callable[[], Callable[[], None]]]  # kind → start; returns the undo


async def one_request(gw: Gateway, ent: str, hold_s: float, run: Run) -> None:
    """What the HTTP handler does with a request: admit, hold, end (an evicted request's lease
    has ended in the store already)."""
    sent = time.monotonic()
    decision = await gw.admit(ent, RequestCost(20, 20))
    reason = None if isinstance(decision, Admit) else decision.reason.value
    run.answers.append(Answer(ent, sent, time.monotonic(), reason))
    if not isinstance(decision, Admit):
        await asyncio.sleep(min(decision.retry_after_s or 0.05, 0.5))  # as clients do
        return
    lease = decision.lease
    handle = AdmittedRequest(asyncio.current_task(), lease)
    gw.admitted_requests[lease.lease_id] = handle
    usage: Usage | None = None
    try:
        await asyncio.sleep(hold_s)
        usage = Usage(20, 10)
    finally:
        gw.admitted_requests.pop(lease.lease_id, None)
        if not handle.evicted:
            gw.ledger.end(lease, usage, gw.clock(), refund=usage is None)


async def drive(
    config: Config,
    topology: Topology,
    faults: list[Fault],
    clients: int = 12,
    load_s: float = 1.2,
    hold_s: tuple[float, float] = (0.005, 0.05),
    who: Callable[[int], str] = lambda i: ENTS[i % 4],
) -> Run:
    prefix = config.state.key_prefix
    gw = Gateway(config, replica=f"faults-{secrets.token_hex(3)}", access_log=False)
    await gw.start(TICK_S, 60.0)
    loop = asyncio.get_running_loop()
    run = Run()
    requests: set[asyncio.Task[None]] = set()

    def disconnect() -> Callable[[], None]:  # half the clients in flight go away
        for task in list(requests)[::2]:
            task.cancel()
        return lambda: None

    kinds = topology.inject | {"cancel": disconnect}
    end = time.monotonic() + load_s
    read = memory_read(gw) if topology.url is None else (lambda: topology.read(prefix))
    sampling = threading.Event()

    def sampler() -> None:  # a thread: it reads on while the gateway's loop is blocked
        while not sampling.is_set():
            with contextlib.suppress(redis.RedisError):
                run.negative += negative(read())
            time.sleep(0.02)

    async def client(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < end:
            task = loop.create_task(one_request(gw, who(i), rng.uniform(*hold_s), run))
            requests.add(task)
            task.add_done_callback(requests.discard)
            await asyncio.wait([task])

    async def inject(fault: Fault) -> None:
        await asyncio.sleep(fault.at_s)
        if fault.kind == "stall":  # the loop blocked for the fault's length
            stall(loop, fault.for_s)
            return
        undo = kinds[fault.kind]()
        try:
            await asyncio.sleep(fault.for_s)
        finally:
            undo()

    watcher = threading.Thread(target=sampler, daemon=True)
    if topology.url is not None:
        watcher.start()
    try:
        await asyncio.gather(*(client(i) for i in range(clients)), *map(inject, faults))
        done = time.monotonic()
        while time.monotonic() - done < 2 * PERIOD_S + 1.0:
            counters = await asyncio.to_thread(read) if topology.url else read()
            run.negative += negative(counters)
            run.left = nonzero(counters) + held(gw)
            if not run.left:
                run.settled_in_s = time.monotonic() - done
                break
            await asyncio.sleep(0.02)
    finally:
        sampling.set()
        for undo in topology.inject.values():
            with contextlib.suppress(Exception):
                undo()()  # every fault undone, whatever happened
        await gw.stop()
    return run


def held(gw: Gateway) -> list[str]:
    """What the gateway itself still holds: requests, fallback leases, owed lease ends."""
    out = [f"request {k}" for k in gw.admitted_requests]
    out += [f"fallback lease {k}" for k in gw.core.fallback.leases]
    owed = getattr(gw.core.store, "owed", 0)
    return out + ([f"{owed} lease ends owed"] if owed else [])


def memory_read(gw: Gateway) -> Callable[[], dict[str, dict[str, float]]]:
    def read() -> dict[str, dict[str, float]]:
        store, now = gw.core.store, gw.clock()
        pool = store.pool_counters("p", now)
        out = {"p": {"conc": pool.concurrency, "kv": pool.kv_tokens, "leases": pool.leases}}
        for name in ENTS:
            e = store.entitlement_counters(name, now)
            out[name] = {"conc": e.concurrency, "kv": e.kv_tokens, "leases": e.leases}
        return out

    return read


def schedules(kinds: tuple[str, ...]) -> st.SearchStrategy[list[Fault]]:
    fault = st.builds(
        Fault,
        at_s=st.floats(0.0, 0.8),
        kind=st.sampled_from(kinds),
        for_s=st.floats(0.05, 0.35),
    )
    return st.lists(fault, min_size=1, max_size=4)


def assert_all_ended(run: Run) -> None:
    assert not run.negative, run.negative[:5]
    assert run.settled_in_s <= 2 * PERIOD_S, f"still booked: {run.left[:8]}"
    assert any(a.reason is None for a in run.answers), "the load ran"


def examples(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# -- the topologies ------------------------------------------------------------------------


def reader(client: Any) -> Callable[[str], dict[str, dict[str, float]]]:
    return lambda prefix: redis_counters(client, ENTS, prefix=prefix)


def paused(start: Callable[[], None], undo: Callable[[], None]) -> Callable[[], Any]:
    def begin() -> Callable[[], None]:
        start()
        return undo

    return begin


@pytest.fixture(scope="module")
def single() -> Iterator[tuple[Topology, FaultProxy]]:
    with redis_server() as (url, proc):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with fault_proxy(port) as proxy:
            client = redis.Redis.from_url(url, socket_timeout=0.5)
            inject = {
                "pause": paused(proxy.pause, proxy.resume),
                "delay": paused(lambda: proxy.delay(0.08), lambda: proxy.delay(0.0)),
                "cut": paused(proxy.cut, proxy.restore),
                "sigstop": paused(lambda: sigstop(proc), lambda: sigcont(proc)),
            }
            yield Topology(proxy.url, reader(client), inject), proxy
            client.close()


def test_on_the_memory_store_every_admission_ends() -> None:
    @examples(6)
    @given(schedules(("stall", "cancel")))
    def check(faults: list[Fault]) -> None:
        topology = Topology(None, lambda _: {}, {})
        assert_all_ended(asyncio.run(drive(fault_config(None, "x"), topology, faults)))

    check()


def test_on_redis_every_admission_ends_whatever_the_faults(
    single: tuple[Topology, FaultProxy],
) -> None:
    topology, _ = single

    @examples(12)
    @given(schedules(("pause", "delay", "cut", "sigstop", "stall", "cancel")))
    def check(faults: list[Fault]) -> None:
        config = fault_config(topology.url, f"f{secrets.token_hex(4)}")
        assert_all_ended(asyncio.run(drive(config, topology, faults)))

    check()


@pytest.mark.parametrize("kind", ["sentinel", "cluster"])
def test_behind_sentinel_and_on_a_cluster_every_admission_ends(kind: str) -> None:
    with topology_of(kind) as topology:

        @examples(3)
        @given(schedules(("sigstop", "stall", "cancel")))
        def check(faults: list[Fault]) -> None:
            config = fault_config(topology.url, f"f{secrets.token_hex(4)}")
            assert_all_ended(asyncio.run(drive(config, topology, faults)))

        check()


@contextlib.contextmanager
def topology_of(kind: str) -> Iterator[Topology]:
    if kind == "sentinel":
        with redis_sentinel() as sentinel:
            master = sentinel.procs[sentinel.master()]
            client = redis.Redis(port=sentinel.master(), socket_timeout=0.5)
            stop = paused(lambda: sigstop(master), lambda: sigcont(master))
            yield Topology(sentinel.url, reader(client), {"sigstop": stop})
            client.close()
        return
    with redis_cluster() as cluster:
        client = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0], socket_timeout=0.5)
        # the prefix is drawn per example, but the pool's hash tag {p} picks the shard
        master = cluster.procs[cluster.master_of("{p}")]
        stop = paused(lambda: sigstop(master), lambda: sigcont(master))
        yield Topology(cluster.url, reader(client), {"sigstop": stop})
        client.close()


# -- the pause scenario --------------------------------------------------------------------


def test_redis_paused_and_resumed_for_four_seconds_leaves_no_slot_booked(
    single: tuple[Topology, FaultProxy],
) -> None:
    """24 clients of short requests; Redis stopped and continued, 200 ms each, for 4 s (a
    failover, a slow fsync, a busy host). Nothing stays booked; the guaranteed tenant, within
    its baseline, is never refused (one replica: its local budget is its whole baseline);
    spot and elastic are refused only while Redis is really unreachable."""
    topology, _ = single
    faults = [Fault(0.4 * i, "sigstop", 0.2) for i in range(10)]
    config = fault_config(topology.url, f"f{secrets.token_hex(4)}", fallback=1.0)
    # the guaranteed tenant within its baseline: one client per slot; the others share the rest
    gold_within = lambda i: "gold" if i < GOLD_BASELINE else ENTS[1 + i % 3]  # noqa: E731
    run = asyncio.run(drive(config, topology, faults, clients=24, load_s=4.2, who=gold_within))
    assert_all_ended(run)
    t0 = min(a.sent for a in run.answers)
    gold = [a for a in run.answers if a.entitlement == "gold"]
    assert gold and all(a.reason is None for a in gold), [
        (round(a.sent - t0, 3), a.reason) for a in gold if a.reason
    ]
    down = [a for a in run.answers if a.reason == Reason.STORE_UNAVAILABLE.value]
    # really unreachable: the call was made during a pause, or within the retry interval and
    # one timeout after one (the first try after the pause is the one that finds it back)
    slack = config.state.retry_interval_s + 2 * TIMEOUT_MS / 1000
    pauses = [(t0 + f.at_s, t0 + f.at_s + f.for_s + slack) for f in faults]
    assert down, "the pauses were noticed"
    stray = [
        a for a in down if not any(lo - 0.1 <= a.decided and a.sent <= hi for lo, hi in pauses)
    ]
    assert not stray, stray[:3]
    served = [a.decided for a in run.answers if a.entitlement != "gold" and a.reason is None]
    gaps = [(t0 + a.at_s + a.for_s, t0 + b.at_s) for a, b in itertools.pairwise(faults)]
    between = [any(lo <= t <= hi for t in served) for lo, hi in gaps]
    assert sum(between) >= len(gaps) - 1, f"served between pauses: {between}"
