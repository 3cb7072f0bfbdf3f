"""Kubernetes resource quantities (resource.Quantity), parsed to exact numbers (pure).

The API server stores a quantity in its canonical form, not as it was written: a lease pod
created asking for "40000" of a resource reads back as "40k", and "1024Ki" as "1Mi". So a
quantity is compared as a number, never as a string.

Not `kubernetes.utils.parse_quantity`: it accepts what the API server refuses ("inf",
"40 k"), and an infinite Decimal cannot be a Fraction."""

from __future__ import annotations

import re
from fractions import Fraction

_SUFFIXES: dict[str, Fraction] = {
    "": Fraction(1),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)|[eE](?P<exp>[+-]?[0-9]+))?"
)
_DECIMAL = (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3))


def parse(text: object) -> Fraction:
    """The exact value of a quantity ("40k", "1Mi", "100m", "1e3", 2): ValueError if it is
    not one."""
    if isinstance(text, bool):
        raise ValueError(f"not a quantity: {text!r}")
    if isinstance(text, int):
        return Fraction(text)
    match = _QUANTITY.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"not a quantity: {text!r}")
    value = Fraction(match["num"])
    if match["exp"] is not None:
        value *= Fraction(10) ** int(match["exp"])
    else:
        value *= _SUFFIXES[match["suffix"] or ""]
    return -value if match["sign"] == "-" else value


def whole(text: object) -> int | None:
    """A quantity that is a whole, non-negative number, as an int; None if it is anything else
    (not a quantity, a fraction, negative)."""
    try:
        value = parse(text)
    except ValueError:
        return None
    if value.denominator != 1 or value < 0:
        return None
    return int(value)


def canonical(value: int) -> str:
    """A whole number as the API server writes back a quantity given in decimal form: the
    largest decimal suffix that keeps it whole ("40000" → "40k", "2" → "2")."""
    for suffix, factor in _DECIMAL:
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)
