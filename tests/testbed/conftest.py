"""Fixtures of the testbed tests: skip the netns tests with a reason without root/netns/htb."""

from __future__ import annotations

import pytest

from flowsched.testbed import netns


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip unless this machine can build the testbed."""
    reason = netns.probe("fsE-t0-")
    if reason is not None:
        pytest.skip(f"testbed unavailable: {reason}")
