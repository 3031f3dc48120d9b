"""TEST SUPPORT for the HA tests: a real etcd per test (skipped with the reason when absent)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowsched.testbed.etcd import etcd_binary, local_etcd


def need_etcd() -> None:
    """Skip the calling test, with the reason, where etcd or its client cannot run."""
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    if importlib.util.find_spec("etcd3gw") is None:
        pytest.skip("the etcd3gw client is not installed (pip install 'flowsched[ha]')")


@pytest.fixture
def etcd_url(tmp_path: Path) -> Iterator[str]:
    """A fresh single-member etcd on free loopback ports (its log: tmp_path/etcd.log)."""
    need_etcd()
    with local_etcd(tmp_path / "etcd.log") as url:
        yield url
