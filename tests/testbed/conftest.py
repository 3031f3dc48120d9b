"""Fixtures of the testbed tests: skip the netns tests with a reason without root/netns/htb;
the prefix locks in a test's own folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowsched import nccl
from flowsched.testbed import netns


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip unless this machine can build the testbed."""
    reason = netns.probe("fsE-t0-")
    if reason is not None:
        pytest.skip(f"testbed unavailable: {reason}")


@pytest.fixture
def lock_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The folder of the prefix locks (:data:`netns.LOCK_DIR`), private to the test."""
    folder = tmp_path / "locks"
    monkeypatch.setattr(netns, "LOCK_DIR", folder)
    return folder


@pytest.fixture(autouse=True)
def plugin_built(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Where this tree has not built the NCCL plugin, ``FLOWSCHED_PLUGIN`` names a stand-in
    file: ``bench.run`` refuses a testbed run without it (``bench.check_plugin``), and the
    tests that fake the testbed never load it. Where it is built, nothing changes."""
    try:
        nccl.plugin_path()
    except nccl.PluginNotFoundError:
        stand_in = tmp_path_factory.mktemp("plugin") / nccl.LIBRARY_NAME
        stand_in.touch()
        monkeypatch.setenv(nccl.PATH_ENV, str(stand_in))
