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
import time
from collections.abc import Callable, Iterator

import aiohttp

# Ports below the kernel's ephemeral range (ip_local_port_range, 32768-60999 by default): a port
# the kernel hands out for an outgoing connection or a listener bound to port 0 cannot be one of
# these, so between the choice and the child's bind only another free_port() can take it, and
# a random draw from thousands makes that rare even with several test workers drawing at once.
_PORTS_FROM = 10000
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nothing listens on now, for a server that is told its port."""
    high = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(_PORTS_FROM, high) if high > _PORTS_FROM + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free loopback port")


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    """`tokenpools ARGS...` in a child process, its output discarded."""
    return subprocess.Popen(
        [sys.executable, "-m", "tokenpools.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=None if os.environ.get("TOKENPOOLS_CHILD_LOGS") else subprocess.DEVNULL,
    )


class ExitedEarly(RuntimeError):
    """The child process ended before it answered."""


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
                raise ExitedEarly(
                    f"{url}: the process exited ({proc.returncode}) before it answered"
                )
            await asyncio.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{url} did not come up")


async def spawn_server(
    args: Callable[[int], list[str]], ready_path: str, timeout_s: float = 15.0, tries: int = 3
) -> tuple[subprocess.Popen[bytes], str]:
    """`tokenpools ARGS(port)` on a free loopback port, once it answers `ready_path`: its URL.
    A port is free when chosen, not when the child binds it (another process may take it in
    between), so a child that exits before it answers is started again on another port."""
    for attempt in range(tries):
        port = free_port()
        proc = spawn(args(port))
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_ready(url + ready_path, proc, timeout_s)
        except ExitedEarly:
            if attempt == tries - 1:
                raise
            continue
        return proc, url
    raise AssertionError("unreachable")


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(10)


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    return binary


def start_redis(port: int, *options: str) -> subprocess.Popen[bytes]:
    """redis-server on loopback `port`, no persistence, ready when this returns; `options`
    are more of redis-server's command-line options."""
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", *options],
        stdout=subprocess.DEVNULL,
        stderr=None if os.environ.get("TOKENPOOLS_CHILD_LOGS") else subprocess.DEVNULL,
    )  # fmt: skip
    wait_port(port, proc)
    return proc


@contextlib.contextmanager
def redis_server(
    port: int | None = None, *options: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A throwaway redis-server: yields (url, process) and kills it afterwards."""
    port = port or free_port()
    proc = start_redis(port, *options)
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
