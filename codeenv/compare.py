"""Comparing a program's answer with the expected one: stdin tests' outputs by a `Compare` mode,
function-call tests' returned values as JSON. Used outside the jail (the judge, the bench)."""

from __future__ import annotations

import math
import re
from typing import Any

from codeenv.models import Compare


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _number(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def close_enough(actual: float, expected: float, tol: float) -> bool:
    """|a - b| <= tol * max(1, |b|); NaN equals only NaN, an infinity only itself."""
    if isinstance(actual, int) or isinstance(expected, int):  # one of them may be past a float's range
        try:
            actual, expected = float(actual), float(expected)
        except OverflowError:  # an int of 309+ digits is no float: close to nothing a float can be
            return False
    if math.isnan(actual) or math.isnan(expected):
        return math.isnan(actual) and math.isnan(expected)
    if math.isinf(actual) or math.isinf(expected):
        return actual == expected
    return abs(actual - expected) <= tol * max(1.0, abs(expected))


#: The words open-r1's Codeforces comparison reads in any case (whole ASCII words, as sed's \b).
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE | re.ASCII)


def _codeforces_tokens(text: str) -> list[str]:
    """open-r1's Codeforces default comparison (its Piston package): the words yes and no
    uppercased, every run of whitespace (newlines, carriage returns) one space, the ends trimmed."""
    return _YES_NO.sub(lambda m: m.group(1).upper(), text).split()


def same_output(actual: str, expected: str, compare: Compare, tol: float) -> bool:
    """Whether a stdin test's output passes under `compare` (see models.Compare)."""
    if compare is Compare.exact:
        return actual == expected
    if compare is Compare.lines:
        return _lines(actual) == _lines(expected)
    if compare is Compare.codeforces:
        return _codeforces_tokens(actual) == _codeforces_tokens(expected)
    got, want = actual.split(), expected.split()
    if compare is Compare.tokens or len(got) != len(want):
        return got == want
    for a, b in zip(got, want, strict=True):
        if a == b:
            continue
        x, y = _number(a), _number(b)
        if x is None or y is None or not close_enough(x, y, tol):
            return False
    return True


def same_value(actual: Any, expected: Any, tol: float) -> bool:
    """Whether a returned value (as JSON) equals the expected one; numbers where either is a float
    by the float rule, booleans never equal to numbers."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(actual, int | float) and isinstance(expected, int | float):
        if isinstance(actual, int) and isinstance(expected, int):
            return actual == expected
        return close_enough(actual, expected, tol)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(same_value(a, e, tol) for a, e in zip(actual, expected,
                                                                                          strict=True))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(same_value(actual[k], expected[k], tol) for k in expected)
    return type(actual) is type(expected) and actual == expected
