"""Build hook: compile the NCCL net plugin (``make -C nccl_plugin``) into the package.

``pip install .`` and ``pip install -e .`` run ``build_py``; this subclass first builds
``nccl_plugin/build/libnccl-net-flowsched.so`` and copies it to ``flowsched/_plugin/`` (in the
build tree, and in the source tree so that editable installs find it too). All metadata lives
in pyproject.toml. Set ``FLOWSCHED_SKIP_PLUGIN=1`` to install without a C compiler.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
LIBRARY = "libnccl-net-flowsched.so"


class BuildWithPlugin(build_py):
    """build_py that also builds and packages the C plugin."""

    def run(self) -> None:
        if os.environ.get("FLOWSCHED_SKIP_PLUGIN") != "1":
            self._build_plugin()
        super().run()

    def _build_plugin(self) -> None:
        subprocess.run(["make", "-C", str(ROOT / "nccl_plugin"), f"build/{LIBRARY}"], check=True)
        built = ROOT / "nccl_plugin" / "build" / LIBRARY
        targets = [ROOT / "flowsched" / "_plugin"]
        if not getattr(self, "editable_mode", False):
            targets.append(Path(self.build_lib) / "flowsched" / "_plugin")
        for folder in targets:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, folder / LIBRARY)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for this platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


#: setup.py commands that compile extensions; any other (pip's metadata step ``dist_info``,
#: ``egg_info``, ``sdist``, ...) gets none, so mypyc's code generation (~20 s) runs only here
BUILD_COMMANDS = {"bdist_wheel", "build", "build_ext", "install", "bdist_egg"}
#: editable installs (PEP 660's ``editable_wheel``, the legacy ``develop``): compiled only
#: with FLOWSCHED_COMPILE=1
EDITABLE_COMMANDS = {"editable_wheel", "develop"}


def compiled_extensions(argv: list[str] = sys.argv) -> list[object]:
    """mypyc's extensions for flowsched/compiled.py's MODULES, or none (see the docstring)."""
    mode = os.environ.get("FLOWSCHED_COMPILE", "auto")
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"FLOWSCHED_COMPILE must be auto, 0 or 1, not {mode!r}")
    commands = set(argv[1:])
    editable = bool(commands & EDITABLE_COMMANDS)
    if mode == "0" or not commands & (BUILD_COMMANDS | EDITABLE_COMMANDS):
        return []
    if mode == "auto" and editable:
        return []
    return list(runpy.run_path(str(ROOT / "flowsched" / "compiled.py"))["extensions"]())


setup(
    cmdclass={"build_py": BuildWithPlugin},
    distclass=BinaryDistribution,
    ext_modules=compiled_extensions(),
)
