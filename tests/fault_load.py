"""The load the store-fault tests and benchmarks drive: the gateway's runtime (`Gateway`: the
core, its store, ticks, hand-over, the owed lease ends) serving closed-loop clients of four
classes the way the HTTP handler does (admit, hold the request, end it; a cancelled client's
request ends too), while a schedule of faults is injected; then how long until every counter
of the ledger is back to 0."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from tests.faults import stall
from tests.ledger_reads import negative, nonzero, redis_counters
from tokenpools.control.decisions import Admit
from tokenpools.gateway.runtime import Gateway
from tokenpools.model.config import Config, parse_config
from tokenpools.model.request import RequestCost, Usage

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
    message: str = ""  # the refusal's, which says whether the local budget decided it


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
    reason, message = (
        (None, "") if isinstance(decision, Admit) else (decision.reason.value, decision.message)
    )
    run.answers.append(Answer(ent, sent, time.monotonic(), reason, message))
    if not isinstance(decision, Admit):
        await asyncio.sleep(min(decision.retry_after_s or 0.05, 0.5))  # as clients do
        return
    admitted = gw.admission.track(decision, asyncio.current_task())
    usage: Usage | None = None
    try:
        await asyncio.sleep(hold_s)
        usage = Usage(20, 10)
    finally:
        admitted.end(usage, refund=usage is None)  # does nothing once evicted


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
    out = [f"request {k}" for k in gw.admission.in_flight]
    out += [f"fallback lease {k}" for k in gw.admission.core.fallback.leases]
    owed = getattr(gw.admission.core.store, "owed", 0)
    return out + ([f"{owed} lease ends owed"] if owed else [])


def memory_read(gw: Gateway) -> Callable[[], dict[str, dict[str, float]]]:
    def read() -> dict[str, dict[str, float]]:
        store, now = gw.admission.core.store, gw.clock()
        pool = store.pool_counters("p", now)
        out = {"p": {"conc": pool.concurrency, "kv": pool.kv_tokens, "leases": pool.leases}}
        for name in ENTS:
            e = store.entitlement_counters(name, now)
            out[name] = {"conc": e.concurrency, "kv": e.kv_tokens, "leases": e.leases}
        return out

    return read


def reader(client: Any) -> Callable[[str], dict[str, dict[str, float]]]:
    return lambda prefix: redis_counters(client, ENTS, prefix=prefix)


def paused(start: Callable[[], None], undo: Callable[[], None]) -> Callable[[], Any]:
    def begin() -> Callable[[], None]:
        start()
        return undo

    return begin
