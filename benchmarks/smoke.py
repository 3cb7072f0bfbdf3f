"""What every benchmark shares: its `--smoke` mode, and the check of the JSON it documents.

`--smoke` runs a benchmark in seconds: the smallest sizes, one repeat, the shortest durations
that still run every section it measures, and writes the same JSON (the numbers mean nothing).
The test suite runs each benchmark so (tests/test_benchmarks_smoke.py) and checks that its
JSON holds every field the script declares in its module-level `FIELDS` (a tuple of strings,
written out: the test reads it without importing the script), so a change that breaks a
benchmark fails CI. An option given on the command line wins over its smoke value.

A field is a path of keys joined by "."; "[]" stands for every item of a list and "*" for
every value of an object (each must hold the rest of the path, and there must be at least
one). For example "[].p99_us" (a list of rows, each with p99_us) or "max_rps.*.runs".
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

HELP = (
    "seconds, not minutes: the smallest sizes and durations that still run every section "
    "(the test suite runs this; the numbers mean nothing)"
)


def parse_args(
    parser: argparse.ArgumentParser, smoke: Mapping[str, Any], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Add `--smoke` to `parser` and parse; with it, `smoke` (option dest → value) replaces
    the defaults of the options the command line does not give."""
    parser.add_argument("--smoke", action="store_true", help=HELP)
    unknown = set(smoke) - {a.dest for a in parser._actions}
    assert not unknown, f"smoke values for no option: {sorted(unknown)}"
    known, _ = parser.parse_known_args(argv)
    if known.smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)


def missing(data: Any, fields: Iterable[str]) -> list[str]:
    """The declared fields that `data` (a benchmark's JSON, loaded) lacks, as paths."""
    return [gap for field in fields for gap in _missing(data, field.split("."), "")]


def _missing(data: Any, path: list[str], at: str) -> list[str]:
    if not path:
        return []
    key, rest = path[0], path[1:]
    here = f"{at}.{key}" if at else key
    if key == "[]":
        if not isinstance(data, list) or not data:
            return [f"{here} (not a non-empty list)"]
        return [g for i, item in enumerate(data) for g in _missing(item, rest, f"{at}[{i}]")]
    if not isinstance(data, dict):
        return [f"{here} (not inside an object)"]
    if key == "*":
        if not data:
            return [f"{here} (an empty object)"]
        return [g for k, v in data.items() for g in _missing(v, rest, f"{at}.{k}" if at else k)]
    if key not in data:
        return [here]
    return _missing(data[key], rest, here)
