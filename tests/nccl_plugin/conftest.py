"""Fixtures for the NCCL plugin tests: the built library (built on demand) and a clean env."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = ROOT / "nccl_plugin"
BUILD = PLUGIN_DIR / "build"


def _build(*targets: str) -> None:
    subprocess.run(
        ["make", "-s", "-C", str(PLUGIN_DIR), *targets], check=True, stdout=subprocess.DEVNULL
    )


@pytest.fixture(scope="session")
def plugin_lib() -> Path:
    """Path of the release build of libnccl-net-flowsched.so (built if needed)."""
    _build("build/libnccl-net-flowsched.so", "build/layout_dump")
    return BUILD / "libnccl-net-flowsched.so"


@pytest.fixture(scope="session")
def layout_dump(plugin_lib: Path) -> Path:
    return BUILD / "layout_dump"


@pytest.fixture
def fresh_lib(plugin_lib: Path, tmp_path: Path) -> Path:
    """A private copy of the library: dlopen gives it its own global state, whatever other
    tests left loaded in this process."""
    copy = tmp_path / "libnccl-net-flowsched-copy.so"
    shutil.copy2(plugin_lib, copy)
    return copy


@pytest.fixture
def plugin_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Loopback only, no agent table unless a test creates one at the returned path."""
    for name in list(os.environ):
        if name.startswith("FLOWSCHED_") or name == "NCCL_SOCKET_IFNAME":
            monkeypatch.delenv(name)
    table = tmp_path / "flowsched-table"
    monkeypatch.setenv("FLOWSCHED_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("FLOWSCHED_TABLE", str(table))
    monkeypatch.setenv("FLOWSCHED_PLUGIN", str(BUILD / "libnccl-net-flowsched.so"))
    yield table
