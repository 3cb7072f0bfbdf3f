"""A throwaway PostgreSQL server for the ledger's tests: Debian's binaries (`.ci/run` installs
`postgresql`), a fresh cluster in a temporary directory, on a free loopback port, trust auth,
killed afterwards. PostgreSQL refuses to run as root: as root it runs as the `postgres` user
the package creates.

`PostgresServer` can also be stopped (a fast shutdown: clients are disconnected, open
transactions rolled back) and started again on the same data directory and port, for the
fault tests: the same URL answers again, with everything committed before the stop."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from tokenpools.processes import free_port


def _binary(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))), None
    )
    if found is None:
        raise RuntimeError(f"{name} not found: apt-get install postgresql")
    return found


class PostgresServer:
    """A cluster of its own (database `postgres`, user `tokenpools`) on a fixed loopback port:
    `start()`, `stop()` and `start()` again keep its data and its URL."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="tokenpools-pg-")
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self.data, self.port = os.path.join(self.root, "data"), free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once: its URL is known, a restart keeps it
        self.log = os.path.join(self.root, "server.log")
        subprocess.run(
            [*self._as_user, _binary("initdb"), "-D", self.data, "-U", "tokenpools",
             "--auth=trust", "-E", "UTF8"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql://tokenpools@127.0.0.1:{self.port}/postgres"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 30) -> None:
        """Start the server (a no-op if it runs); returns once it accepts a connection. A
        server that exits while it starts (its port taken between `free_port` and the bind,
        or what its log says: `log_tail`) is started again, on another port the first time
        (a restart keeps its URL)."""
        if self.running:
            return
        for _ in range(3):
            with contextlib.suppress(FileNotFoundError):  # left by a server killed outright
                os.remove(os.path.join(self.root, f".s.PGSQL.{self.port}"))
            with open(self.log, "ab") as log:
                self._proc = subprocess.Popen(
                    [*self._as_user, _binary("postgres"), "-D", self.data, "-p", str(self.port),
                     "-k", self.root, "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                    stdout=log,
                    stderr=log,
                )  # fmt: skip
            if self._accepts(timeout_s):
                self._started = True
                return
            if not self._started:
                self.port = free_port()
        raise RuntimeError(f"postgres did not start: {self.log_tail()}")

    def _accepts(self, timeout_s: float) -> bool:
        """Whether this server accepts a connection on its own socket (a port that answers
        may be another server's); False once it has exited."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while self._proc.poll() is None:
            try:
                self.connect_local().close()
                return True
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not start: {self.log_tail()}") from None
                time.sleep(0.05)
        return False

    def connect_local(self) -> psycopg.Connection[Any]:
        """A connection over this server's own socket, as its superuser (trusted there)."""
        return psycopg.connect(host=self.root, port=self.port, user="tokenpools",
                               dbname="postgres", autocommit=True, connect_timeout=2)  # fmt: skip

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError), open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def stop(self, mode: str = "fast", timeout_s: float = 30) -> None:
        """Shut the server down (`fast`: disconnect clients, roll back what is open; `immediate`:
        as a crash would); returns once its process has exited."""
        if not self.running:
            return
        subprocess.run(
            [*self._as_user, _binary("pg_ctl"), "stop", "-D", self.data, "-m", mode, "-w",
             "-t", str(int(timeout_s))],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert self._proc is not None
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)

    def close(self) -> None:
        """Stop the server and remove its data."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def restartable_postgres() -> Iterator[PostgresServer]:
    """A started `PostgresServer`, removed afterwards."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    except BaseException:
        print(f"postgres's log, last lines:\n{server.log_tail()}")  # shown with the failure
        raise
    finally:
        server.close()


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields the server's URL (database `postgres`, user `tokenpools`)."""
    with restartable_postgres() as server:
        yield server.url
