"""The architecture's nevers (docs/architecture.md), read off the source's imports: the pure
core imports no host; no host imports another; usage/ never imports admission/; identity/ and
admission/ import no server library; no package imports one that imports it; and hosts never
reach into the runtime's core or driver."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "tokenpools"
HOSTS = {"gateway", "integrations", "sim", "emulator", "k8s", "extproc", "authz"}
PURE = {"control", "model", "state"}


def _package(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _imports() -> dict[str, set[tuple[str, str]]]:
    """Package → {(file, imported module)} for every tokenpools module a file imports, and
    the third-party modules too (by their top name)."""
    found: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                found[_package(path)].add((str(path.relative_to(SRC)), name))
    return found


IMPORTS = _imports()


def _targets(package: str) -> set[str]:
    return {
        name.split(".")[1].removesuffix(".py")
        for _, name in IMPORTS[package]
        if name.startswith("tokenpools.") and len(name.split(".")) > 1
    }


@pytest.mark.parametrize("package", sorted(PURE))
def test_the_pure_core_imports_no_host_and_no_runtime(package: str) -> None:
    assert not _targets(package) & (HOSTS | {"admission", "usage", "identity"})


# The one crossing: `tokenpools serve --kubernetes` and the LiteLLM hook in a cluster read
# their config from the cluster through the k8s package's config source (its API client,
# watches, CR -> config and the loop that follows them), not through the operator; so do
# `extproc --kubernetes` and `authz --kubernetes`, through host_config.py, no host's.
CONFIG_SOURCE = {
    (where, f"tokenpools.k8s.{module}")
    for where in ("gateway/server.py", "integrations/config_source.py")
    for module in ("source", "api", "following")
}


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_no_host_imports_another(host: str) -> None:
    crossing = {
        (f, n)
        for f, n in IMPORTS[host]
        if n.startswith("tokenpools.") and n.split(".")[1] in HOSTS - {host}
    }
    assert crossing <= CONFIG_SOURCE


def test_usage_never_imports_admission_and_admission_no_host() -> None:
    assert "admission" not in _targets("usage")
    assert not _targets("admission") & HOSTS


@pytest.mark.parametrize("package", ["identity", "admission", "control", "state", "model"])
def test_no_server_library_below_the_hosts(package: str) -> None:
    servers = {"aiohttp.web", "fastapi", "litellm", "grpc", "starlette"}
    bad = {(f, n) for f, n in IMPORTS[package] if n in servers or n.startswith("aiohttp.web")}
    assert not bad
    if package != "identity":  # identity fetches the JWKS with aiohttp's client, nothing else
        assert not {(f, n) for f, n in IMPORTS[package] if n.split(".")[0] == "aiohttp"}


def test_no_package_cycle() -> None:
    graph = {p: _targets(p) - {p} for p in IMPORTS}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, set()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(p for p in graph if reaches(p, p, {p}))
    allowed = {"cli", "commands"}  # the command line and its groups: one face, split in files
    assert set(cycles) <= allowed, cycles


def test_hosts_never_reach_into_the_runtimes_parts() -> None:
    reach = re.compile(r"\.(admission|runtime)\.(core|driver)\b|\bgw\.(core|driver)\b")
    offenders = [
        f"{path.relative_to(SRC)}:{n}"
        for host in HOSTS
        for path in (SRC / host).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reach.search(line)
    ]
    assert not offenders
