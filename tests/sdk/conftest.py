"""The SDK tests' agent: a real one on its own thread, its socket under the test's folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flowsched.agent import AgentConfig
from flowsched.agent.threaded import AgentThread


@pytest.fixture
def agent(tmp_path: Path, fresh_sdk_connections: None) -> Iterator[AgentThread]:
    """An agent with its socket at ``tmp_path/s/agent.sock`` (16 slots, no metrics, no
    coordinator, local fallback after 60 s); the SDK's connections are closed after it."""
    config = AgentConfig(
        node="n1",
        socket_path=str(tmp_path / "s" / "agent.sock"),
        table_path=str(tmp_path / "table"),
        num_slots=16,
        metrics_port=None,
        fallback_after=60.0,
        interfaces=("lo",),
    )
    with AgentThread(config) as running:
        yield running
