"""Optional compiled build: TOKENPOOLS_COMPILE=1 compiles the decision core and the memory
store with mypyc (C extensions, same source, same tests). Everything else is in pyproject.toml."""

import os

from setuptools import setup

COMPILED = [
    "src/tokenpools/state/accounts.py",
    "src/tokenpools/state/memory.py",
    "src/tokenpools/control/autoscale.py",
    "src/tokenpools/control/binding.py",
    "src/tokenpools/control/catalog.py",
    "src/tokenpools/control/core.py",
    "src/tokenpools/control/decisions.py",
    "src/tokenpools/control/observation.py",
    "src/tokenpools/control/placement.py",
    "src/tokenpools/control/plans.py",
    "src/tokenpools/control/priority.py",
    "src/tokenpools/control/retry.py",
    "src/tokenpools/control/store.py",
    "src/tokenpools/model/resources.py",
    "src/tokenpools/model/request.py",
]

ext_modules = []
if os.environ.get("TOKENPOOLS_COMPILE") == "1":
    from mypyc.build import mypycify

    ext_modules = mypycify(COMPILED, opt_level="3")

setup(ext_modules=ext_modules)
