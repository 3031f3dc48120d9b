"""Scheduling policies: one module each, one registry (this file).

Each policy module exports ``NAME``, an ``Args`` dataclass with the defaults, ``validate(args,
path) -> list[str]`` (errors that name the field path) and ``new(args, num_levels) -> Policy``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from flowsched.policies.base import Policy

#: policy name -> module under flowsched.policies
_MODULES: dict[str, str] = {
    "rmlq": "rmlq",
    "fair": "fair",
    "static": "static",
    "pias": "pias",
    "sjf": "sjf",
    "edf": "edf",
    "karuna": "karuna",
    "llf": "llf",
}

#: Policies that use knowledge no real deployment has; reported as references, not competitors.
ORACLES = frozenset({"llf"})


def names() -> list[str]:
    """All registered policy names."""
    return list(_MODULES)


def module(name: str) -> ModuleType:
    """The module implementing policy ``name``; raise KeyError with the known names otherwise."""
    if name not in _MODULES:
        raise KeyError(f"unknown policy {name!r} (known: {', '.join(_MODULES)})")
    return importlib.import_module(f"flowsched.policies.{_MODULES[name]}")


def create(name: str, args: Mapping[str, Any] | None = None, *, num_levels: int = 8) -> Policy:
    """Build policy ``name`` with ``args`` (validated; ValueError lists every bad field)."""
    mod = module(name)
    errors = mod.validate(dict(args or {}), "policy.args")
    if errors:
        raise ValueError("; ".join(errors))
    policy: Policy = mod.new(dict(args or {}), num_levels=num_levels)
    return policy


__all__ = ["ORACLES", "Policy", "create", "module", "names"]
