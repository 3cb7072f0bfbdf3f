"""The decision core and the memory store compiled with mypyc (C extensions from the same
source, ~2-3x the admission rate) on every install; TOKENPOOLS_PURE=1 skips compiling, and an
install where compiling fails (no C compiler, no mypy) falls back to the pure-Python code with
a warning. `tokenpools check-config` says which one runs. Everything else is in pyproject.toml."""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

COMPILED = [
    "src/tokenpools/state/accounts.py",
    "src/tokenpools/state/checks.py",
    "src/tokenpools/state/memory_book.py",
    "src/tokenpools/state/memory.py",
    "src/tokenpools/state/metering.py",
    "src/tokenpools/control/autoscale.py",
    "src/tokenpools/control/backfill.py",
    "src/tokenpools/control/binding.py",
    "src/tokenpools/control/budgets.py",
    "src/tokenpools/control/catalog.py",
    "src/tokenpools/control/core.py",
    "src/tokenpools/control/decisions.py",
    "src/tokenpools/control/endings.py",
    "src/tokenpools/control/eviction.py",
    "src/tokenpools/control/gatekeeper.py",
    "src/tokenpools/control/layers.py",
    "src/tokenpools/control/metering.py",
    "src/tokenpools/control/observation.py",
    "src/tokenpools/control/periodic.py",
    "src/tokenpools/control/pipeline.py",
    "src/tokenpools/control/placement.py",
    "src/tokenpools/control/plans.py",
    "src/tokenpools/control/priority.py",
    "src/tokenpools/control/retry.py",
    "src/tokenpools/control/store.py",
    "src/tokenpools/control/store_reads.py",
    "src/tokenpools/control/store_terms.py",
    "src/tokenpools/control/views.py",
    "src/tokenpools/model/resources.py",
    "src/tokenpools/model/request.py",
]


def _warn(message: str) -> None:
    print(f"tokenpools: {message}; installing the pure-Python core", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """A failed C build installs the pure-Python modules instead of failing: all of the
    extensions or none (they share one mypyc runtime library)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            _warn(f"compiling the core failed ({exc})")
            for path in self.get_outputs():  # stale builds of a previous run included
                if os.path.exists(path):
                    os.remove(path)


def compiled_modules() -> list:  # type: ignore[type-arg]
    if os.environ.get("TOKENPOOLS_PURE") == "1":
        return []
    try:
        from mypyc.build import mypycify

        return mypycify(COMPILED, opt_level="3")
    except Exception as exc:  # mypyc missing, or the type check it runs failed
        _warn(f"mypyc is unavailable ({exc})")
        return []


setup(ext_modules=compiled_modules(), cmdclass={"build_ext": OptionalBuildExt})
