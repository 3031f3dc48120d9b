"""The flowsched NCCL net plugin seen from Python: where the library is, and a ctypes driver.

``plugin_path()`` returns the absolute path of ``libnccl-net-flowsched.so``: the file named by
``FLOWSCHED_PLUGIN`` when set, else the copy installed in the package, else a build in the
source tree's ``nccl_plugin/build/``;
``flowsched.nccl.harness`` loads it and drives its ``ncclNetPlugin_v10/11/12`` tables the way
NCCL's service and progress threads do.
"""

from __future__ import annotations

import os
from pathlib import Path

LIBRARY_NAME = "libnccl-net-flowsched.so"
PLUGIN_NAME = "flowsched"


class PluginNotFoundError(FileNotFoundError):
    """The plugin library was neither installed nor built."""


#: environment variable naming the library explicitly (tests, development builds)
PATH_ENV = "FLOWSCHED_PLUGIN"


def candidate_paths() -> list[Path]:
    """Where ``plugin_path`` looks, in order."""
    package_dir = Path(__file__).resolve().parent.parent
    explicit = [Path(os.environ[PATH_ENV]).resolve()] if os.environ.get(PATH_ENV) else []
    return [
        *explicit,
        package_dir / "_plugin" / LIBRARY_NAME,
        package_dir.parent / "nccl_plugin" / "build" / LIBRARY_NAME,
    ]


def plugin_path() -> Path:
    """Absolute path of the built plugin; raises PluginNotFoundError naming the places tried."""
    explicit = os.environ.get(PATH_ENV)
    if explicit and not Path(explicit).is_file():
        raise PluginNotFoundError(f"{PATH_ENV}={explicit} is not a file")
    for path in candidate_paths():
        if path.is_file():
            return path
    tried = ", ".join(str(p) for p in candidate_paths())
    raise PluginNotFoundError(
        f"{LIBRARY_NAME} not found (tried {tried}); build it with `make -C nccl_plugin` "
        "or reinstall flowsched with `pip install .`"
    )
