"""The locks (locks/*.txt) still match pyproject.toml: every environment `make test` builds is
installed from them, so a range changed without `make lock` must fail here, naming the fix."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from scripts import locks

PYPROJECT = locks.read_pyproject()


def _lock(name: str) -> locks.Lock:
    return next(lock for lock in locks.locks(PYPROJECT) if lock.name == name)


def _with_dependency(pyproject: locks.Pyproject, old: str, new: str) -> locks.Pyproject:
    changed = copy.deepcopy(pyproject)
    deps = changed["project"]["dependencies"]
    deps[deps.index(old)] = new
    return changed


def test_the_committed_locks_match_pyproject() -> None:
    assert locks.check() == []
    assert subprocess.run([sys.executable, locks.__file__, "check"]).returncode == 0


def test_every_lock_pins_every_input_with_hashes() -> None:
    for lock in locks.locks(PYPROJECT):
        text = lock.path.read_text()
        pins = locks.locked(text)
        assert pins, lock.name
        assert all(len(p.specifier) == 1 and next(iter(p.specifier)).operator == "==" for p in pins)
        entries = [line for line in text.splitlines() if "==" in line and "--hash" not in line]
        assert len(entries) == len(pins)
        assert text.count("--hash=sha256:") >= len(pins), lock.name  # a hash for each pin
        names = {p.name.lower() for p in pins}
        for req in locks.inputs(lock, PYPROJECT):
            if req.marker is None or req.marker.evaluate():
                assert req.name.lower() in names, (lock.name, req.name)


def test_a_range_moved_past_the_locked_version_fails_naming_the_package() -> None:
    old = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("pydantic"))
    locked = next(
        p for p in locks.locked(_lock("dev").path.read_text()) if p.name == "pydantic"
    ).specifier
    version = next(iter(locked)).version
    major = int(version.split(".")[0])
    changed = _with_dependency(PYPROJECT, old, f"pydantic>={major + 1}")
    found = locks.check(changed)
    assert f"dev.txt: pydantic=={version} is outside pyproject's '>={major + 1}'" in found
    assert f"litellm.txt: pydantic=={version} is outside pyproject's '>={major + 1}'" in found


def test_a_range_changed_but_still_satisfied_fails_on_the_recorded_inputs() -> None:
    old = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("pyyaml"))
    changed = _with_dependency(PYPROJECT, old, "pyyaml>=5.0,<7")  # the lock still fits it
    found = locks.check(changed)
    assert "dev.txt was made from other inputs than pyproject.toml's now" in found
    assert not any("outside" in problem for problem in found)


def test_a_new_dependency_without_a_lock_fails() -> None:
    changed = copy.deepcopy(PYPROJECT)
    changed["project"]["optional-dependencies"]["dev"].append("no-such-package-xyz>=1")
    found = locks.check(changed)
    assert "dev.txt: no-such-package-xyz is not locked" in found
    assert not any(problem.startswith("litellm.txt") for problem in found)  # not its input


def test_the_command_exits_1_and_says_to_run_make_lock(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    old = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("pydantic"))
    changed = _with_dependency(PYPROJECT, old, "pydantic>=2.7,<3")
    monkeypatch.setattr(locks, "read_pyproject", lambda: changed)
    assert locks.main(["check"]) == 1
    err = capsys.readouterr().err
    assert "dev.txt was made from other inputs than pyproject.toml's now" in err
    assert all(line.endswith("run `make lock` to refresh it") for line in err.splitlines())


def test_inputs_follow_the_projects_own_extras_once() -> None:
    dev = [str(r) for r in locks.inputs(_lock("dev"), PYPROJECT)]
    assert not any(Requirement(r).name == "tokenpools" for r in dev)
    for name in ("matplotlib", "kopf", "grpcio", "psycopg", "pytest", "setuptools"):
        assert any(Requirement(r).name == name for r in dev), name  # sim, k8s, extproc, build
    assert not any(Requirement(r).name == "litellm" for r in dev)
    assert locks.digest(locks.inputs(_lock("dev"), PYPROJECT)) == locks.digest(
        reversed(locks.inputs(_lock("dev"), PYPROJECT))
    )


def test_locked_reads_markers_and_continuations() -> None:
    text = (
        "# a comment\n"
        "numpy==2.4.6 ; python_full_version < '3.12' \\\n"
        "    --hash=sha256:aa \\\n"
        "    --hash=sha256:bb\n"
        "    # via matplotlib\n"
        "numpy==2.5.5 ; python_full_version >= '3.12' \\\n"
        "    --hash=sha256:cc\n"
        "uv==0.13.8 --hash=sha256:dd\n"
    )
    pins = locks.locked(text)
    assert [(p.name, str(p.specifier)) for p in pins] == [
        ("numpy", "==2.4.6"), ("numpy", "==2.5.5"), ("uv", "==0.13.8"),
    ]  # fmt: skip
    assert [str(p.marker) if p.marker else None for p in pins] == [
        'python_full_version < "3.12"', 'python_full_version >= "3.12"', None,
    ]  # fmt: skip
