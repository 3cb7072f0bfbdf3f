"""A booked admission always ends, whatever happens between the store and its caller.

The gateway's runtime serves closed-loop clients of four classes (tests/fault_load.py) while
hypothesis draws a schedule of faults: a loopback TCP proxy between the gateway and Redis that
delays, pauses or cuts the connection; SIGSTOP/SIGCONT of the redis-server (the master, behind
Sentinel or in a Cluster); the gateway's event loop blocked by a slow callback; clients that
disconnect at once. Once the clients are done, every pool's and entitlement's in-flight, KV
and lease counters are back to 0 within two update periods, with the lease TTL at its default
(600 s: nothing is left to expire), and no counter is ever negative (sampled every 20 ms by a
client of the test's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fault_load import (
    ENTS,
    GOLD_BASELINE,
    PERIOD_S,
    TIMEOUT_MS,
    Fault,
    Run,
    Topology,
    drive,
    fault_config,
    paused,
    reader,
)
from tests.faults import FaultProxy, fault_proxy, sigcont, sigstop
from tests.redis_topologies import redis_cluster, redis_sentinel
from tokenpools.control.decisions import Reason
from tokenpools.processes import redis_server


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
        (round(a.sent - t0, 3), round(a.decided - t0, 3), a.reason, a.message)
        for a in gold
        if a.reason
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
