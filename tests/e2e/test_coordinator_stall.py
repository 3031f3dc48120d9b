"""A stalled coordinator (SIGSTOP, then SIGCONT) gets its agent back without a false alarm.

The agent gives up on the silent link and reconnects; when the coordinator resumes it may
handle the new handshake before the old connection's end. That is one agent reconnecting,
not "two agents use the same --node name" (which the coordinator used to log).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from e2e_helpers import wait_for
from test_preauth_floods import CONNECTS, agent_counters, coordinator_and_agent

pytestmark = pytest.mark.slow


def _established(port: int) -> int:
    """Connections to local ``port`` in state ESTABLISHED (/proc/net/tcp)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
            count += 1
    return count


def test_an_agent_reconnecting_after_a_coordinator_stall_is_not_two_agents(
    tmp_path: Path, token: Path
) -> None:
    with coordinator_and_agent(tmp_path, token) as setup:
        before = agent_counters(setup.agent)[CONNECTS]
        pid = setup.coordinator.proc.pid
        agent_log = tmp_path / "agent-n1.log"
        port = int(setup.coordinator.fields["port"])
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: "coordinator link lost" in agent_log.read_text(), 10, "a lost link")
            # the agent's new connection waits in the stopped coordinator's accept queue (the
            # old one is in CLOSE_WAIT): the race the false alarm came from
            wait_for(lambda: _established(port) >= 1, 10, "a new connection in the queue")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: agent_counters(setup.agent)[CONNECTS] > before, 15, "a reconnect")
        coordinator_log = tmp_path / "coordinator.log"
        wait_for(
            lambda: coordinator_log.read_text().count("agent n1 connected from") >= 2,
            10,
            "the coordinator to log the reconnect",
        )
        log = coordinator_log.read_text()
    assert "two agents use the same --node name" not in log
    assert "another agent uses --node" not in agent_log.read_text()
