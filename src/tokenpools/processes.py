"""Helper processes on loopback: the demo and the benchmarks run emulators and gateways as
their own processes, so each keeps time whatever the others do."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

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
        stderr=subprocess.DEVNULL,
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
