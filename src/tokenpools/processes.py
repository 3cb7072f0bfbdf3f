"""Helper processes on loopback: the demo and the benchmarks run emulators and gateways as
their own processes, so each keeps time whatever the others do."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    """`tokenpools ARGS...` in a child process, its output discarded."""
    return subprocess.Popen(
        [sys.executable, "-m", "tokenpools.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=None if os.environ.get("TOKENPOOLS_CHILD_LOGS") else subprocess.DEVNULL,
    )


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """Poll `url` until it answers 200; fail early if the process has died."""
    async with aiohttp.ClientSession() as session:
        for _ in range(int(timeout_s / 0.05)):
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{url} did not come up")


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(10)


def start_redis(port: int) -> subprocess.Popen[bytes]:
    """redis-server on loopback `port`, no persistence, ready when this returns."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=None if os.environ.get("TOKENPOOLS_CHILD_LOGS") else subprocess.DEVNULL,
    )
    wait_port(port, proc)
    return proc


@contextlib.contextmanager
def redis_server(port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A throwaway redis-server: yields (url, process) and kills it afterwards."""
    port = port or free_port()
    proc = start_redis(port)
    try:
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait(10)


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """Poll until something accepts connections on `port`; fail early if `proc` died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port}")


@dataclass
class RedisCluster:
    """A Redis Cluster of redis-server processes on loopback."""

    ports: list[int]
    procs: dict[int, subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        """The `state.url` of a store on this cluster (every node a seed)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def info(self, port: int) -> dict[str, str]:
        out = subprocess.run(
            [_redis_cli(), "-p", str(port), "cluster", "info"], capture_output=True, text=True
        ).stdout
        return dict(line.split(":", 1) for line in out.split() if ":" in line)

    def _replication(self, port: int) -> str:
        return subprocess.run(
            [_redis_cli(), "-p", str(port), "info", "replication"], capture_output=True, text=True
        ).stdout.replace("\r", "")

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key` now."""
        alive = next(p for p in self.ports if self.procs[p].poll() is None)
        cli = [_redis_cli(), "-p", str(alive)]
        slot = int(subprocess.run([*cli, "cluster", "keyslot", key], capture_output=True).stdout)
        for line in subprocess.run(
            [*cli, "cluster", "nodes"], capture_output=True, text=True
        ).stdout.splitlines():
            fields = line.split()
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            for part in fields[8:]:
                lo, _, hi = part.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return int(fields[1].split(":")[1].split("@")[0])
        raise RuntimeError(f"no master serves slot {slot}")

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [p for p in self.ports if self.procs[p].poll() is None]
            # ok, and every replica in sync: one that never synced will not take over
            if all(self.info(p).get("cluster_state") == "ok" for p in live) and all(
                "master_link_status:down" not in self._replication(p) for p in live
            ):
                return
            time.sleep(0.1)
        nodes = subprocess.run(
            [_redis_cli(), "-p", str(live[0]), "cluster", "nodes"], capture_output=True, text=True
        ).stdout
        repl = "\n".join(self._replication(p) for p in live)
        raise RuntimeError(f"the cluster did not reach cluster_state:ok:\n{nodes}\n{repl}")


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


def _redis_cli() -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError("redis-cli is not installed (apt-get install redis-server)")
    return binary


@contextlib.contextmanager
def redis_cluster(
    masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
) -> Iterator[RedisCluster]:
    """A throwaway Redis Cluster: `masters` shards, each with `replicas` replicas, built by
    `redis-cli --cluster create`; a replica takes over a master dead for `node_timeout_ms`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    with tempfile.TemporaryDirectory() as workdir:
        ports = [_cluster_port() for _ in range(masters * (1 + replicas))]
        procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for port in ports:
                procs[port] = subprocess.Popen(
                    [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", workdir, "--cluster-enabled", "yes",
                     "--cluster-config-file", f"nodes-{port}.conf",
                     "--cluster-node-timeout", str(node_timeout_ms),
                     "--repl-diskless-sync-delay", "0"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )  # fmt: skip
                wait_port(port, procs[port])
            subprocess.run(
                [_redis_cli(), "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                check=True,
                capture_output=True,
            )  # fmt: skip
            cluster = RedisCluster(ports, procs)
            cluster.wait_ok()
            yield cluster
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait(10)
