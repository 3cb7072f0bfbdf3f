"""The value classes built on every request or tick write their `__init__` out, so mypyc
compiles it (the one @dataclass generates runs interpreted, ~6× slower; control/store_terms.py says
more above Lease). A written one must still be the dataclass's: its fields, in order, with
their defaults, frozen where declared frozen."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import types

import pytest

import tokenpools
from tokenpools.control.core import Pending
from tokenpools.control.decisions import Admit, Check, Quota, Reason, Reject
from tokenpools.control.metering import Charge, Meter
from tokenpools.control.observation import Observation
from tokenpools.control.store import (
    EntitlementCounters,
    Lease,
    Outcome,
    PoolCounters,
    Scores,
    Window,
)
from tokenpools.model.request import Account, RequestCost, Usage
from tokenpools.model.resources import Resources

# Built per request (admission, settlement) or per entitlement in every tick.
HOT = (
    Lease, Pending, Outcome, PoolCounters, EntitlementCounters, Charge, Meter, Admit, Reject,
    Quota, RequestCost, Usage, Account, Window, Scores, Observation, Resources,
)  # fmt: skip
PURE = tokenpools.core_build() == "pure Python"


def _generated(cls: type) -> bool:
    init = cls.__init__  # type: ignore[misc]
    # @dataclass compiles its methods from source text: their code comes from "<string>"
    return isinstance(init, types.FunctionType) and init.__code__.co_filename == "<string>"


def _dataclasses() -> list[type]:
    found: dict[str, type] = {}
    for package in ("control", "state", "model"):
        module = importlib.import_module(f"tokenpools.{package}")
        for info in pkgutil.walk_packages(module.__path__, module.__name__ + "."):
            for obj in vars(importlib.import_module(info.name)).values():
                if (
                    isinstance(obj, type)
                    and dataclasses.is_dataclass(obj)
                    and obj.__module__ == info.name
                ):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


@pytest.mark.parametrize("cls", HOT, ids=lambda c: c.__name__)
def test_hot_values_write_their_init(cls: type) -> None:
    assert not _generated(cls), f"{cls.__name__}.__init__ is @dataclass's, run interpreted"


@pytest.mark.skipif(not PURE, reason="signatures are read from the pure-Python build")
@pytest.mark.parametrize("cls", [c for c in _dataclasses() if not _generated(c)], ids=repr)
def test_a_written_init_takes_the_fields_in_order_with_their_defaults(cls: type) -> None:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # type: ignore[misc]
    fields = [f for f in dataclasses.fields(cls) if f.init]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, p
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == default, f"{cls.__name__}.{f.name}: {p.default!r} != {default!r}"


def test_a_written_init_sets_every_field_and_keeps_frozen_values_frozen() -> None:
    charge = Charge(1.0, 2.0, 3.0, 4.0, 5.0)
    assert (charge.input, charge.output, charge.cached, charge.tokens, charge.cost) == (
        1.0, 2.0, 3.0, 4.0, 5.0,
    )  # fmt: skip
    assert charge == Charge(input=1.0, output=2.0, cached=3.0, tokens=4.0, cost=5.0)
    assert hash(charge) == hash(Charge(1.0, 2.0, 3.0, 4.0, 5.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        charge.input = 9.0  # type: ignore[misc]
    window = Window(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, peak_kv=7.0)
    assert dataclasses.astuple(window) == (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 7.0)
    assert dataclasses.replace(Scores(debt=1.0), burst=2.0) == Scores(1.0, 2.0)
    lease = Lease("l", "p", "e", 10.0, 20.0, 0.0, 30.0, True, meter=None)
    assert (lease.tokens, lease.expires_at, lease.preemptible, lease.drew_own) == (
        10.0, 30.0, True, False,
    )  # fmt: skip
    # a constant beside written fields: readable on an instance of either build, and not a
    # field (mypyc counts a ClassVar among the fields, and replace() then fails)
    admit = Admit(lease, 1.0)
    assert admit.admitted is True
    assert dataclasses.replace(admit, lowered=True) == Admit(lease, 1.0, lowered=True)
    assert "admitted" not in {f.name for f in dataclasses.fields(Admit)}
    refused = Reject(Reason.POOL_FULL, Check.CAPACITY, "full")
    assert refused.admitted is False
    assert dataclasses.replace(refused, max_tokens_fit=3).max_tokens_fit == 3


def test_written_inits_still_refuse_what_the_dataclass_refused() -> None:
    with pytest.raises(ValueError, match="input_tokens must be >= 0"):
        RequestCost(-1)
    with pytest.raises(ValueError, match="sequences must be >= 1"):
        RequestCost(1, sequences=0)
    with pytest.raises(ValueError, match="max_output_tokens must be >= 0"):
        RequestCost(1, -5)
    with pytest.raises(ValueError, match="usage must be non-negative"):
        Usage(1, -1)
