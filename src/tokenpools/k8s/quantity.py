"""Kubernetes resource quantities (resource.Quantity), parsed to exact numbers (pure).

The API server stores a quantity in its canonical form, not as it was written: a lease pod
created asking for "40000" of a resource reads back as "40k", and "1024Ki" as "1Mi". So a
quantity is compared as a number, never as a string.

Not `kubernetes.utils.parse_quantity`: it accepts what the API server refuses ("inf",
"40 k"), and an infinite Decimal cannot be a Fraction."""

from __future__ import annotations

import re
from fractions import Fraction

_PREFIXES = "kMGTPE"  # powers of 1000; upper-cased and followed by "i", of 1024 ("Ki", ...)
_DECIMAL = tuple((p, 1000 ** (n + 1)) for n, p in enumerate(_PREFIXES))  # k = 10**3, ... E
_SUFFIXES: dict[str, Fraction] = {
    "": Fraction(1),
    "m": Fraction(1, 1000),
    **{p: Fraction(factor) for p, factor in _DECIMAL},
    **{f"{p.upper()}i": Fraction(1024 ** (n + 1)) for n, p in enumerate(_PREFIXES)},
}
_SUFFIX = "|".join(sorted(filter(None, _SUFFIXES), key=len, reverse=True))  # "Ki" before "k"
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    rf"(?:(?P<suffix>{_SUFFIX})|[eE](?P<exp>[+-]?[0-9]+))?"
)


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
    for suffix, factor in reversed(_DECIMAL):  # the largest first
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)
