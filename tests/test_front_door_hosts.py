"""The host sequence exists once: every host admits through the front door's entry
(`FrontDoor.identify`, then `FrontDoor.enter`) and does none of its steps itself — no body
parsed, no route, no prompt counted, no admission, no tracking, no identity or decision written
into the record, no refusal metric. Read off each host's source, so a step written again in a
host fails here even where every behaviour test still passes."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

HOSTS = {
    "tokenpools.gateway.inference": {"identify", "enter"},
    "tokenpools.extproc.flow": {"identify", "enter"},
    "tokenpools.integrations.litellm": {"enter"},  # LiteLLM identifies the caller itself
}
# What the front door does, named as a host would call it.
STEPS = {
    "parse_body",  # the body's fields
    "route",  # the pool and the caller's layers
    "count",  # the prompt
    "admit",
    "track",  # the admitted request, until its end
    "caller",  # who calls (the identity rules)
    "identified",  # the record's and the metrics' identity
    "decided",  # the record's decision
    "demand",
    "write_back",
    "include_usage",
}


def _calls(module: str) -> tuple[set[str], set[str]]:
    """The names a module calls (`f(...)`, `x.f(...)`) and the attributes it reads."""
    spec = importlib.util.find_spec(module)  # found, not imported: LiteLLM may be absent
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    called, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            called.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
        elif isinstance(node, ast.Attribute):
            read.add(node.attr)
    return called, read


@pytest.mark.parametrize("module", sorted(HOSTS))
def test_each_host_admits_through_the_front_door_only(module: str) -> None:
    called, read = _calls(module)
    assert HOSTS[module] <= called, f"{module} does not call the front door's {HOSTS[module]}"
    assert not called & STEPS, f"{module} does the front door's {sorted(called & STEPS)} itself"
    assert "unauthorized" not in read, f"{module} counts refused credentials itself"


def test_the_check_sees_a_step_written_again() -> None:
    """The reading above finds what it looks for (a host that parsed its body would fail)."""
    called, _ = _calls("tokenpools.admission.front_door")
    assert {"parse_body", "identified", "decided", "track", "admit"} <= called
