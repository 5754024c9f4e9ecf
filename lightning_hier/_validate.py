"""Argument checks with one message format: who, which argument, the bad value, what is allowed.

Strategies call these in their constructors, so bad values fail before any process starts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any, TypeVar

T = TypeVar("T")


def _fail(owner: str, name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{owner}: argument `{name}` must be {allowed}, got {value!r}.")


def check_int(owner: str, name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer of any integral type (``int``, ``numpy.int64``, ...; not a bool) within ``[minimum, maximum]``."""
    number = _integer(value, minimum, maximum)
    if number is None:
        raise _fail(owner, name, value, "an integer" + _bounds(minimum, maximum, True, True))
    return number


def check_int_list(
    owner: str,
    name: str,
    value: Any,
    minimum: int | None = None,
    maximum: int | None = None,
    length: int | None = None,
    increasing: bool = False,
    allowed: str | None = None,
) -> list[int]:
    """A non-empty list, tuple or 1-D array of integers (any integral type, not bools), as a list of plain ints.

    Args:
        owner: Class or function named in the message.
        name: Argument named in the message.
        value: The value to check.
        minimum: Smallest allowed entry.
        maximum: Largest allowed entry.
        length: Required number of entries (``None``: any number but zero).
        increasing: Entries must be strictly increasing.
        allowed: What is allowed, in the message (default: built from the other arguments).
    """
    listlike = isinstance(value, Sequence) and not isinstance(value, str | bytes)
    listlike = listlike or getattr(value, "ndim", None) == 1  # a 1-D numpy array: its items are numpy integers
    entries = list(value) if listlike else None
    ints = [i for i in (_integer(x, minimum, maximum) for x in entries or []) if i is not None]
    wanted = len(ints) == length if length is not None else bool(ints)
    ok = entries is not None and len(ints) == len(entries) and wanted
    if ok and increasing:
        ok = all(a < b for a, b in pairwise(ints))
    if not ok:
        if allowed is None:
            size = f"a list of {length}" if length is not None else "a non-empty list of"
            order = " strictly increasing" if increasing else ""
            allowed = f"{size}{order} integers{_bounds(minimum, maximum, True, True)}"
        raise _fail(owner, name, value, allowed)
    return ints


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
    # "finite" in every message: inf passes open-ended bounds but breaks every computation later
    allowed = "a finite number" + _bounds(low, high, low_inclusive, high_inclusive)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(owner, name, value, allowed)
    number = float(value)
    if not math.isfinite(number):
        raise _fail(owner, name, value, allowed)
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
    """``True`` or ``False`` (not a number standing for one)."""
    if not isinstance(value, bool):
        raise _fail(owner, name, value, "True or False")
    return value


def as_int(value: Any) -> int | None:
    """``value`` as a plain ``int`` if its type is integral (``int``, ``numpy.int64``, ...; not bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)  # a plain int from here on (numpy integers overflow silently)


def _integer(value: Any, minimum: int | None, maximum: int | None) -> int | None:
    """``value`` as a plain int if it is an integer within the bounds, else ``None``."""
    number = as_int(value)
    if number is None or (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        return None
    return number


def _bounds(low: float | None, high: float | None, low_inc: bool, high_inc: bool) -> str:
    if low is not None and high is not None:
        return f" in {'[' if low_inc else '('}{low}, {high}{']' if high_inc else ')'}"
    if low is not None:
        return f" {'>=' if low_inc else '>'} {low}"
    if high is not None:
        return f" {'<=' if high_inc else '<'} {high}"
    return ""
