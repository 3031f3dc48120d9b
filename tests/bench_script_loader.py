"""Load a benchmark script of ``bench/`` as a module, for its tests.

``bench/`` is no package (nothing is importable as ``bench``), so its scripts are loaded by
path, under their file's stem, in ``sys.modules`` only while they execute (``dataclasses``
looks a class's module up there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(relative: str) -> ModuleType:
    """The module of ``bench/<relative>`` (e.g. ``"gpu/allreduce_check.py"``), executed."""
    path = BENCH / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    before = sys.modules.get(spec.name)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del sys.modules[spec.name]
        else:
            sys.modules[spec.name] = before
    return module
