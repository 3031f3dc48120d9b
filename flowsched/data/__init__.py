"""Files shipped inside the package: policy files, simulator scenarios, the contention benchmark.

Layout (the repository's ``policies/``, ``bench/scenarios/`` and ``bench/contention/policies/``
are symbolic links into this directory, so one copy serves a checkout and an installed wheel)::

    policies/*.toml               policy files (``flowsched policy list``)
    scenarios/*.toml              simulator scenarios (``flowsched sim pd-serving``)
    contention/scenario.toml      the contention benchmark's trace knobs
    contention/policies/*.toml    the policies the benchmark compares

Read them through :func:`data_path`, never through a path relative to the source tree.
"""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent


def data_path(*parts: str) -> Path:
    """The path of a shipped file or folder, e.g. ``data_path("scenarios", "mixed.toml")``.

    Wheels are installed unpacked, so this is a real path (never inside a zip archive).
    """
    return _ROOT.joinpath(*parts)
