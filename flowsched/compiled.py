"""The modules a wheel compiles with mypyc, and whether this process runs them compiled.

The coordinator spends its time per event in the flow table, the policy and the decoding of
the agents' frames: these modules.
``pip install .`` (a wheel, the container image) compiles them to C extensions with mypyc
(setup.py); an editable install (``pip install -e .``, what scripts/setup.sh makes for
development) keeps them as Python, so that an edit takes effect without a rebuild.
``FLOWSCHED_COMPILE=0`` builds a wheel without them, ``=1`` compiles an editable install too.
The compiled and the interpreted modules take the same decisions: tests/packaging/
test_wheel.py runs the policy, flow-table, protocol and simulator tests on a built wheel,
compares the simulator's results and the codec's answer to every test frame with the Python
source's; bench/coordinator_load.py measures both side by side (``--build``).

setup.py reads :data:`MODULES` by executing this file alone: it must import nothing from
flowsched at module level.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Source files compiled by mypyc, relative to the repository root.
MODULES = (
    "flowsched/model.py",
    "flowsched/policies/common.py",
    "flowsched/policies/feasibility.py",
    "flowsched/policies/rmlq.py",
    "flowsched/coordinator/state.py",
    "flowsched/protocol/_framing.py",
    "flowsched/protocol/_codec.py",
)

#: The name mypyc gives the library shared by the compiled modules (``<group>__mypyc``).
GROUP = "flowsched"


def extensions() -> list[Any]:
    """The setuptools extensions of :data:`MODULES` (run from the repository root)."""
    _mypy_version()  # a clear message when mypy is missing
    from mypyc.build import mypycify

    return list(mypycify(list(MODULES), group_name=GROUP, opt_level="3"))


def module_names() -> list[str]:
    """Dotted names of :data:`MODULES`."""
    return [path.removesuffix(".py").replace("/", ".") for path in MODULES]


def compiled_modules() -> list[str]:
    """Which of :data:`MODULES` this process imports from a C extension."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = ((name, importlib.util.find_spec(name)) for name in module_names())
    return [name for name, spec in found if spec and str(spec.origin).endswith(suffixes)]


def is_compiled() -> bool:
    """True when every module of :data:`MODULES` runs compiled in this process."""
    return len(compiled_modules()) == len(MODULES)


def build_tree(repo: Path, cache: Path) -> Path:
    """A copy of ``repo``'s flowsched package with :data:`MODULES` compiled in place.

    For benchmarks that run the compiled build next to the editable (interpreted) one: put
    the returned folder first on ``PYTHONPATH`` (and use it as the working directory). The
    tree is keyed by a hash of every source file of the package and the mypy version, so a
    stale build is never reused; building takes about half a minute. After a build, only the
    :data:`KEEP_TREES` most recently used trees stay (:func:`prune_trees`).

    Raises:
        RuntimeError: mypy is missing, or mypyc or the C compiler failed (their output).
    """
    source = repo / "flowsched"
    files = sorted(p for p in source.rglob("*.py") if "__pycache__" not in p.parts)
    digest = hashlib.sha256(_mypy_version().encode())
    for path in [*files, repo / "pyproject.toml"]:
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes())
    tree = cache / digest.hexdigest()[:16]
    if (tree / ".built").exists():
        (tree / ".built").touch()  # its last use, for prune_trees
        return tree
    staging = cache / f"{tree.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(
        source,
        staging / "flowsched",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "_plugin"),
    )
    shutil.copy2(repo / "pyproject.toml", staging)  # mypy's settings
    build = (  # the same extensions as setup.py's, built in place
        "import runpy, setuptools; found = runpy.run_path('flowsched/compiled.py');"
        "setuptools.setup(name='flowsched', ext_modules=found['extensions'](),"
        " script_args=['build_ext', '--inplace'])"
    )
    built = subprocess.run(
        [sys.executable, "-c", build], cwd=staging, capture_output=True, text=True, timeout=900
    )
    if built.returncode != 0:
        raise RuntimeError(f"mypyc failed ({built.returncode}):\n{built.stdout}{built.stderr}")
    shutil.rmtree(staging / "build", ignore_errors=True)
    (staging / ".built").write_text(" ".join(MODULES) + "\n")
    shutil.rmtree(tree, ignore_errors=True)
    staging.rename(tree)
    prune_trees(cache, keep=KEEP_TREES)
    return tree


#: built trees :func:`build_tree` keeps: each source edit makes a new one (16 MB here)
KEEP_TREES = 3


def prune_trees(cache: Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` most recently used built trees in ``cache``, and staging
    folders of builds that died a day or more ago; the folders removed.

    A tree's last use is its ``.built`` file's mtime. Folders without that file other than
    stale staging ones are left alone (another process may be building there).
    """
    built = sorted(
        (path for path in cache.iterdir() if (path / ".built").is_file()),
        key=lambda path: (path / ".built").stat().st_mtime,
        reverse=True,
    )
    day_ago = time.time() - 86400
    stale = [
        path for path in cache.glob("*.partial") if path.is_dir() and path.stat().st_mtime < day_ago
    ]
    removed = built[keep:] + stale
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _mypy_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError as missing:
        needed = "building the compiled modules needs mypy (pip install mypy)"
        raise RuntimeError(needed) from missing
    return str(__version__)
