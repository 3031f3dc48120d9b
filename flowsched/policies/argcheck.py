"""Small validators shared by the policy modules' ``validate(args, path)`` functions.

Every checker returns a list of error strings, each naming the field path (for example
``"policy.args.E: expected a number > 1, got 0.5"``), so that callers can collect all errors of
a policy file at once instead of stopping at the first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from flowsched.model import FlowClass

#: a checker takes (value, field path) and returns the errors for that value
Checker = Callable[[Any, str], list[str]]


def is_number(value: object) -> bool:
    """True for int/float values that are finite (bool is not a number here), an int past
    a float's range (a TOML integer of 400 digits) not included."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_int(value: object) -> TypeGuard[int]:
    """True for ints that are not bools."""
    return isinstance(value, int) and not isinstance(value, bool)


def number(
    low: float | None = None, high: float | None = None, *, open_low: bool = False
) -> Checker:
    """A checker for a finite number in ``[low, high]`` (``(low, high]`` with ``open_low``)."""

    def check(value: Any, path: str) -> list[str]:
        if not is_number(value):
            return [f"{path}: expected {_range_text(low, high, open_low)}, got {value!r}"]
        too_low = low is not None and (value <= low if open_low else value < low)
        if too_low or (high is not None and value > high):
            return [f"{path}: expected {_range_text(low, high, open_low)}, got {value!r}"]
        return []

    return check


def integer(low: int | None = None, high: int | None = None) -> Checker:
    """A checker for an integer in ``[low, high]``."""

    def check(value: Any, path: str) -> list[str]:
        if (
            not is_int(value)
            or (low is not None and value < low)
            or (high is not None and value > high)
        ):
            return [
                f"{path}: expected {_range_text(low, high, False, 'an integer')}, got {value!r}"
            ]
        return []

    return check


def boolean(value: Any, path: str) -> list[str]:
    """A checker for a bool."""
    return [] if isinstance(value, bool) else [f"{path}: expected true or false, got {value!r}"]


def optional(inner: Checker) -> Checker:
    """``inner``, but None is also accepted (TOML cannot say None; Python callers can)."""
    return lambda value, path: [] if value is None else inner(value, path)


def one_of(*choices: str) -> Checker:
    """A checker for one string out of ``choices``."""

    def check(value: Any, path: str) -> list[str]:
        if value not in choices:
            return [f"{path}: expected one of {', '.join(map(repr, choices))}, got {value!r}"]
        return []

    return check


def list_of(inner: Checker, *, min_len: int = 0) -> Checker:
    """A checker for a list whose items all pass ``inner``."""

    def check(value: Any, path: str) -> list[str]:
        if not isinstance(value, list | tuple):
            return [f"{path}: expected a list, got {value!r}"]
        if len(value) < min_len:
            return [f"{path}: expected at least {min_len} item(s), got {len(value)}"]
        return [e for i, item in enumerate(value) for e in inner(item, f"{path}[{i}]")]

    return check


def class_map(inner: Checker) -> Checker:
    """A checker for a table keyed by flow-class label (``tp``, ``kv``...)."""

    def check(value: Any, path: str) -> list[str]:
        if not isinstance(value, Mapping):
            return [f"{path}: expected a table keyed by class, got {value!r}"]
        labels = {c.label for c in FlowClass}
        errors: list[str] = []
        for key, item in value.items():
            if key not in labels:
                known = ", ".join(sorted(labels))
                errors.append(f"{path}.{key}: unknown flow class (expected one of: {known})")
            else:
                errors.extend(inner(item, f"{path}.{key}"))
        return errors

    return check


def check_fields(args: Mapping[str, Any], path: str, spec: Mapping[str, Checker]) -> list[str]:
    """Errors for unknown keys of ``args`` and for every known key whose value fails its checker."""
    if not isinstance(args, Mapping):
        return [f"{path}: expected a table, got {args!r}"]
    errors: list[str] = []
    for key, value in args.items():
        checker = spec.get(key)
        if checker is None:
            errors.append(f"{path}.{key}: unknown key (known: {', '.join(spec) or 'none'})")
        else:
            errors.extend(checker(value, f"{path}.{key}"))
    return errors


def _range_text(
    low: float | None, high: float | None, open_low: bool, noun: str = "a number"
) -> str:
    if low is None and high is None:
        return noun
    if high is None:
        return f"{noun} {'>' if open_low else '>='} {low}"
    if low is None:
        return f"{noun} <= {high}"
    return f"{noun} in {'(' if open_low else '['}{low}, {high}]"
