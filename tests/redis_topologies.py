"""Throwaway Redis topologies on loopback for the tests and benchmarks: a Redis Cluster
(`redis-cli --cluster create`) and a master with replicas behind Sentinel."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenpools.processes import free_port, redis_server_binary, start_redis, wait_port


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
    binary = redis_server_binary()
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


@dataclass
class RedisSentinel:
    """A master with replicas, watched by sentinels; `url` is the `state.url` that names them."""

    service: str
    sentinel_ports: list[int]
    procs: dict[int, subprocess.Popen[bytes]]  # by port: the data nodes and the sentinels

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{seeds}/{self.service}"

    def master(self) -> int:
        """The port of the master, as a majority of the live sentinels sees it."""
        seen: list[int] = []
        for port in self.sentinel_ports:
            out = subprocess.run(
                [_redis_cli(), "-p", str(port), "sentinel", "get-master-addr-by-name",
                 self.service],
                capture_output=True, text=True,
            ).stdout.split()  # fmt: skip
            if len(out) == 2:
                seen.append(int(out[1]))
        return max(set(seen), key=seen.count)


@contextlib.contextmanager
def redis_sentinel(
    replicas: int = 1, sentinels: int = 3, down_after_ms: int = 1000
) -> Iterator[RedisSentinel]:
    """A throwaway master, `replicas` replicas and `sentinels` sentinels (quorum: a majority)
    on loopback; the sentinels fail over to a replica once the master is down for
    `down_after_ms`."""
    service = "tokenpools"
    with tempfile.TemporaryDirectory() as workdir:
        procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            master = free_port()
            procs[master] = start_redis(master, "--repl-diskless-sync-delay", "0")
            for _ in range(replicas):
                port = free_port()
                procs[port] = start_redis(port, "--replicaof", "127.0.0.1", str(master))
            ports = [free_port() for _ in range(sentinels)]
            for port in ports:
                conf = Path(workdir) / f"sentinel-{port}.conf"  # sentinels rewrite their config
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
                    f"sentinel monitor {service} 127.0.0.1 {master} {sentinels // 2 + 1}\n"
                    f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                    f"sentinel failover-timeout {service} {down_after_ms * 3}\n"
                )
                procs[port] = subprocess.Popen(
                    [redis_server_binary(), str(conf), "--sentinel"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                wait_port(port, procs[port])
            topology = RedisSentinel(service, ports, procs)
            _wait_replicas_known(topology, replicas)
            yield topology
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait(10)


def _wait_replicas_known(topology: RedisSentinel, replicas: int, timeout_s: float = 30) -> None:
    """Until every sentinel knows every replica, and the others (a failover needs both)."""
    deadline = time.monotonic() + timeout_s
    want = {"num-slaves": replicas, "num-other-sentinels": len(topology.sentinel_ports) - 1}
    while time.monotonic() < deadline:
        ready = 0
        for port in topology.sentinel_ports:
            fields = subprocess.run(
                [_redis_cli(), "-p", str(port), "sentinel", "master", topology.service],
                capture_output=True, text=True,
            ).stdout.split()  # fmt: skip
            info = dict(zip(fields[::2], fields[1::2], strict=False))
            ready += all(info.get(k) == str(v) for k, v in want.items())
        if ready == len(topology.sentinel_ports):
            return
        time.sleep(0.1)
    raise RuntimeError("the sentinels did not learn the replicas and each other in time")
