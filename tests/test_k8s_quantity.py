"""Kubernetes quantities are parsed to exact numbers, whatever form the API server stores."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tokenpools.k8s.quantity import canonical, parse, whole


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("40000", 40_000), ("40k", 40_000), ("2k", 2_000), ("3M", 3 * 10**6),
        ("1G", 10**9), ("1T", 10**12), ("1P", 10**15), ("2E", 2 * 10**18),
        ("1Ki", 1024), ("4Mi", 4 * 2**20), ("1Gi", 2**30), ("1Ti", 2**40),
        ("1Pi", 2**50), ("1Ei", 2**60), ("1e3", 1000), ("1E3", 1000), ("2e-3", Fraction(1, 500)),
        ("100m", Fraction(1, 10)), ("1.5k", 1500), (".5", Fraction(1, 2)), ("+7", 7),
        (8, 8),
    ],
)  # fmt: skip
def test_quantities_parse_to_numbers(text: str | int, value: int | Fraction) -> None:
    assert parse(text) == value


@pytest.mark.parametrize("text", ["", "k", "40 k", "1Kb", "abc", "1.2.3", "0x10"])
def test_what_is_not_a_quantity(text: str) -> None:
    with pytest.raises(ValueError):
        parse(text)
    assert whole(text) is None


def test_whole_and_canonical() -> None:
    assert whole("40k") == 40_000 and whole("1500m") is None and whole("-1") is None
    assert [canonical(n) for n in (40_000, 2_000, 2, 0, 1_500, 3_000_000)] == [
        "40k", "2k", "2", "0", "1500", "3M"
    ]  # fmt: skip
    assert all(parse(canonical(n)) == n for n in (1, 999, 1000, 123_000_000))
