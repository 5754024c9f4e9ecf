"""Argument checks with one message format: who, which argument, the bad value, what is allowed.

Strategies call these in their constructors, so bad values fail before any process starts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def _fail(owner: str, name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{owner}: argument `{name}` must be {allowed}, got {value!r}.")


def check_int(owner: str, name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer of any integral type (``int``, ``numpy.int64``, ...; not a bool) within ``[minimum, maximum]``."""
    allowed = "an integer" + _bounds(minimum, maximum, True, True)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(owner, name, value, allowed)
    value = int(value)  # a plain int from here on (numpy integers overflow silently)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _fail(owner, name, value, allowed)
    return value


def check_float(
    owner: str,
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """A finite real number (of any real type, not a bool) within the given (half-)open or closed interval."""
    allowed = "a number" + _bounds(low, high, low_inclusive, high_inclusive)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise _fail(owner, name, value, allowed)
    number = float(value)
    if not math.isfinite(number):  # inf passes open-ended bounds but breaks every computation later
        raise _fail(owner, name, value, "a finite number" + _bounds(low, high, low_inclusive, high_inclusive))
    too_low = low is not None and (number < low or (number == low and not low_inclusive))
    too_high = high is not None and (number > high or (number == high and not high_inclusive))
    if too_low or too_high:
        raise _fail(owner, name, value, allowed)
    return number


def check_choice(owner: str, name: str, value: T, choices: Iterable[T]) -> T:
    """One of ``choices``."""
    options = list(choices)
    if value not in options:
        raise _fail(owner, name, value, "one of " + ", ".join(repr(c) for c in options))
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(owner, name, value, "True or False")
    return value


def _bounds(low: float | None, high: float | None, low_inc: bool, high_inc: bool) -> str:
    if low is not None and high is not None:
        return f" in {'[' if low_inc else '('}{low}, {high}{']' if high_inc else ')'}"
    if low is not None:
        return f" {'>=' if low_inc else '>'} {low}"
    if high is not None:
        return f" {'<=' if high_inc else '<'} {high}"
    return ""
