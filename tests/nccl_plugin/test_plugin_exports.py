"""What NCCL's loader sees: exactly the tables ncclNetPlugin_v8 .. _v12, all named flowsched,
found by plugin_path() and by `flowsched plugin-path`."""

from __future__ import annotations

import _ctypes
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flowsched.cli import main as cli_main
from flowsched.nccl import LIBRARY_NAME, candidate_paths, plugin_path

VERSIONS = (8, 9, 10, 11, 12)


def test_exports_exactly_the_net_tables(plugin_lib: Path) -> None:
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(plugin_lib)], check=True, capture_output=True, text=True
    ).stdout
    symbols = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert symbols == sorted(f"ncclNetPlugin_v{v}" for v in VERSIONS)


@pytest.mark.parametrize("version", VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def test_table_names_the_plugin(plugin_lib: Path, version: int) -> None:
    lib = ctypes.CDLL(str(plugin_lib), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    name = ctypes.c_char_p.in_dll(lib, f"ncclNetPlugin_v{version}")
    assert name.value == b"flowsched"
    _ctypes.dlclose(lib._handle)


def test_no_other_tables(plugin_lib: Path) -> None:
    lib = ctypes.CDLL(str(plugin_lib), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    for version in (6, 7, 13):
        with pytest.raises(ValueError):
            ctypes.c_void_p.in_dll(lib, f"ncclNetPlugin_v{version}")
    _ctypes.dlclose(lib._handle)


def test_plugin_path_finds_the_library(plugin_lib: Path) -> None:
    path = plugin_path()
    assert path.is_absolute() and path.name == LIBRARY_NAME and path in candidate_paths()


def test_cli_plugin_path(plugin_lib: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plugin-path"]) == 0
    assert Path(capsys.readouterr().out.strip()) == plugin_path()


def test_cli_plugin_info(plugin_env: Path, plugin_lib: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flowsched", "plugin", "info", "--version", "12"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert '"name": "flowsched"' in out and '"name": "lo"' in out


def test_cli_plugin_info_says_when_nccl_would_not_use_the_plugin(
    plugin_env: Path, plugin_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOWSCHED_SOCKET_IFNAME", "nothing-like-this")
    proc = subprocess.run(
        [sys.executable, "-m", "flowsched", "plugin", "info"], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stderr
    assert "NCCL would not use the plugin: devices returned 0" in proc.stderr
    assert "Traceback" not in proc.stderr
