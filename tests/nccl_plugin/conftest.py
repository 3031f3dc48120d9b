"""Fixtures for the NCCL plugin tests: the built library (built on demand), a clean env, and
the settings of a real agent serving the plugin's table."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowsched.agent import AgentConfig

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


@pytest.fixture(scope="session")
def fstcp_lib() -> Path:
    """The standalone build of our TCP transport: an inner plugin for wrapping mode."""
    _build("build/libnccl-net-fstcp.so")
    return BUILD / "libnccl-net-fstcp.so"


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


@pytest.fixture
def local_agent_config(tmp_path: Path, plugin_env: Path) -> AgentConfig:
    """A standalone agent (no coordinator, no metrics port) on loopback serving the table at
    ``plugin_env``'s path."""
    return AgentConfig(
        node="n1",
        socket_path=str(tmp_path / "run" / "agent.sock"),
        table_path=str(plugin_env),
        num_slots=16,
        metrics_port=None,
        interfaces=("lo",),
    )
