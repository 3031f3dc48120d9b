"""This release's programs next to the previous release's, as they run during a rolling
upgrade: the previous release is the repository at :data:`PREVIOUS_RELEASE` (protocol 1, the
last commit before protocol 2), extracted from git and run from its own folder.

* a new agent against a previous coordinator: by default it refuses that coordinator, which
  cannot prove that it holds the token (protocol 3 can); with ``--allow-unproven-coordinator``
  (upgrading agents first) its offer of version 3 is refused, it reconnects offering 1, and
  its flows are ranked by that coordinator;
* a previous agent against a new coordinator: version 1, its progress sent as maps is decoded;
  applications on this release's SDK open flows through that agent.

Skipped with the reason where the repository's history is not there (a shallow clone, an
unpacked archive).
"""

from __future__ import annotations

import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from e2e_helpers import (
    agent_in_session,
    cleanup,
    scrape,
    start_agent,
    start_coordinator,
    total,
    wait_for,
)

from flowsched import client
from flowsched.model import FlowClass
from flowsched.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.usefixtures("fresh_sdk_connections")

ROOT = Path(__file__).resolve().parents[2]
#: protocol 1: the commit before f5486d9 ("protocol 2: flows progress as two uint64 arrays")
PREVIOUS_RELEASE = "9a0b2409f0c4a1640a3f4c86eea54b8e505292be"
ACTIVE = "flowsched_coordinator_active_flows"


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the previous release's ``flowsched`` package (the Python programs;
    its NCCL plugin is not built)."""
    folder = tmp_path_factory.mktemp("previous-release")
    archive = folder / "release.tar"
    made = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), PREVIOUS_RELEASE, "flowsched"],
        capture_output=True, text=True,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"the previous release is not in this checkout's history: {made.stderr}")
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder


def _ranks_a_kv_flow(coordinator_metrics: str, sock: str) -> None:
    """An SDK ``kv`` flow with a far deadline, opened through the agent at ``sock`` (in session:
    :func:`agent_in_session`), gets the coordinator's deferred level (not its class default), is
    counted by the coordinator, its progress decoded, and goes when closed."""
    deadline = time.time() + 60
    with client.flow("kv", bytes=1 << 30, deadline=deadline, socket_path=sock) as kv:
        assert kv.connected
        assert kv.level > client.static_marking(FlowClass.KV).level, kv.level
        wait_for(lambda: total(scrape(coordinator_metrics), ACTIVE) == 1, 5, "the flow")
        kv.progress(1 << 20)  # reported at version 1: a map per report
        progress = "flowsched_coordinator_events_total"
        wait_for(lambda: total(scrape(coordinator_metrics), progress, kind="progress") >= 1, 5,
                 "the progress report")  # fmt: skip
    wait_for(lambda: total(scrape(coordinator_metrics), ACTIVE) == 0, 5, "the flow to close")


def test_a_new_agent_refuses_a_previous_coordinator_by_default(
    tmp_path: Path, token: Path, previous: Path
) -> None:
    log = tmp_path / "agent-n1.log"
    with cleanup() as started:
        coord = start_coordinator(tmp_path, token, cwd=previous)
        started.append(coord)
        port = coord.fields["port"]
        agent = start_agent(tmp_path, token, int(port))
        started.append(agent)
        wait_for(lambda: "unproven_coordinator" in log.read_text(), 10, "the refusal")
        cm = coord.fields["mport"]
        assert total(scrape(cm), "flowsched_coordinator_agents_connected") == 0
    agent_log = log.read_text()
    assert (
        f"refused coordinator 127.0.0.1:{port}: unproven_coordinator: the coordinator refused"
        f" protocol version {PROTOCOL_VERSION} (hello: unknown field(s) nonce)" in agent_log
    ), agent_log[-2000:]
    assert "--allow-unproven-coordinator" in agent_log
    assert "connected to the coordinator" not in agent_log
    assert "reconnecting with version 1" not in agent_log  # its MAC never went there
    assert "unknown field(s) nonce" in (tmp_path / "coordinator.log").read_text()


def test_a_new_agent_allowed_to_follow_a_previous_coordinator(
    tmp_path: Path, token: Path, previous: Path
) -> None:
    with cleanup() as started:
        coord = start_coordinator(tmp_path, token, cwd=previous)
        started.append(coord)
        agent = start_agent(
            tmp_path, token, int(coord.fields["port"]), extra=("--allow-unproven-coordinator",)
        )
        started.append(agent)
        cm = coord.fields["mport"]
        wait_for(lambda: total(scrape(cm), "flowsched_coordinator_agents_connected") == 1, 10,
                 "the agent to connect")  # fmt: skip
        wait_for(lambda: agent_in_session(agent), 10, "the agent's session")
        _ranks_a_kv_flow(cm, agent.fields["socket"])
    agent_log = (tmp_path / "agent-n1.log").read_text()
    assert f"refused protocol version {PROTOCOL_VERSION}" in agent_log, agent_log[-2000:]
    assert "; protocol version 1;" in agent_log, agent_log[-2000:]
    assert "cannot prove that it holds the token" in agent_log, agent_log[-2000:]
    assert "unknown field(s) nonce" in (tmp_path / "coordinator.log").read_text()


def test_a_previous_agent_follows_a_new_coordinator(
    tmp_path: Path, token: Path, previous: Path
) -> None:
    with cleanup() as started:
        coord = start_coordinator(tmp_path, token)
        started.append(coord)
        agent = start_agent(tmp_path, token, int(coord.fields["port"]), cwd=previous)
        started.append(agent)
        cm = coord.fields["mport"]
        wait_for(lambda: total(scrape(cm), "flowsched_coordinator_agents_connected") == 1, 10,
                 "the agent to connect")  # fmt: skip
        wait_for(lambda: agent_in_session(agent), 10, "the agent's session")
        _ranks_a_kv_flow(cm, agent.fields["socket"])
    assert "protocol version" not in (tmp_path / "agent-n1.log").read_text()  # (it predates it)
