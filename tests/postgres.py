"""A throwaway PostgreSQL server for the ledger's tests: Debian's binaries (`.ci/run` installs
`postgresql`), a fresh cluster in a temporary directory, on a free loopback port, trust auth,
killed afterwards. PostgreSQL refuses to run as root: as root it runs as the `postgres` user
the package creates."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

from tokenpools.processes import free_port, wait_port


def _binary(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))), None
    )
    if found is None:
        raise RuntimeError(f"{name} not found: apt-get install postgresql")
    return found


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields the server's URL (database `postgres`, user `tokenpools`)."""
    root = tempfile.mkdtemp(prefix="tokenpools-pg-")
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(root, "data"), free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.run(
        [*as_user, _binary("initdb"), "-D", data, "-U", "tokenpools", "--auth=trust", "-E", "UTF8"],
        check=True,
        **quiet,
    )
    proc = subprocess.Popen(
        [*as_user, _binary("postgres"), "-D", data, "-p", str(port), "-k", root,
         "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
        **quiet,
    )  # fmt: skip
    try:
        wait_port(port, proc, timeout_s=30)
        yield f"postgresql://tokenpools@127.0.0.1:{port}/postgres"
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
