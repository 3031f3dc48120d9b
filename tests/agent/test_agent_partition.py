"""An agent cut off from its coordinator by the network, then connected again.

The real coordinator runs in the netns testbed's switch namespace and one agent per host
(as ``flowsched bench contention`` runs them); taking a host's management link down at the
switch cuts that agent off silently, as a pulled cable does: no reset, no refusal, its
connects time out. The agent must notice from the silence alone and run the policy locally,
keep trying, and once the link is back reconnect, resync its open flows and stop the local
policy; the coordinator closes the silent connection after its idle timeout. Run with ``-s``
for the times.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowsched import client
from flowsched.testbed import netns
from flowsched.testbed.daemons import wait_for
from flowsched.testbed.runner import private_token, start_agents

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("fresh_sdk_connections"),
]

POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.toml"
RESYNC = re.compile(r"connected to the coordinator .*; resync sent \((\d+) flows\)")


@pytest.fixture
def topo(tmp_path: Path) -> Iterator[netns.Topology]:
    """Two testbed hosts, their agents and the coordinator (logs in ``tmp_path``)."""
    spec = netns.TopologySpec(prefix="fsA-", hosts=2)
    try:
        with netns.testbed(spec) as built, private_token() as token:
            procs: list[subprocess.Popen[bytes]] = []
            try:
                start_agents(built, procs, POLICY, spec.rate_bytes, tmp_path, token=token)
                # an agent is ready before its first session: the test counts on that session
                # (its resync of no flows) before it opens one and cuts the link
                for host in built.hosts:
                    _wait_for_session(tmp_path / f"agent-{host.name}.log")
                yield built
            finally:
                for proc in procs:
                    proc.terminate()
                for proc in procs:
                    proc.wait(timeout=10)
    except netns.TestbedUnavailable as unavailable:
        pytest.skip(f"testbed unavailable: {unavailable}")


def _wait_for_session(agent_log: Path) -> None:
    """Until the agent's log says it took a coordinator's welcome and sent its resync."""
    wait_for(lambda: RESYNC.search(agent_log.read_text()), 15, f"a session in {agent_log.name}")


def test_an_agent_cut_off_from_its_coordinator_falls_back_and_rejoins(
    topo: netns.Topology, tmp_path: Path
) -> None:
    agent_log, coordinator_log = tmp_path / "agent-h0.log", tmp_path / "coordinator.log"
    sock = str(tmp_path / "h0.sock")
    with client.flow("kv", bytes=1 << 30, deadline=time.time() + 120, socket_path=sock) as kv:
        assert kv.connected
        topo.set_control_link("h0", up=False)
        fell_back = wait_for(
            lambda: re.search(r"running \w+ locally", agent_log.read_text()), 15, "the local policy"
        )  # fmt: skip
        timed_out = wait_for(
            lambda: "did not answer within" in agent_log.read_text(), 15, "a connect timeout"
        )  # fmt: skip
        wait_for(lambda: "node=h0 state=established: timeout" in coordinator_log.read_text(), 15,
                 "the coordinator to close the silent connection")  # fmt: skip
        topo.set_control_link("h0", up=True)
        rejoined = wait_for(
            lambda: "coordinator back: local policy stopped" in agent_log.read_text(), 15,
            "the agent to rejoin",
        )  # fmt: skip
        assert kv.connected  # the SDK's connection is to the agent, which stayed up
    resyncs = [int(n) for n in RESYNC.findall(agent_log.read_text())]
    assert resyncs == [0, 1], resyncs  # at start: nothing open; after the cut: the kv flow
    assert "refused" not in agent_log.read_text()  # a silent cut, not a refusal
    print(
        f"\ncut -> local policy {fell_back:.2f} s, first connect timeout after "
        f"{fell_back + timed_out:.2f} s; link back -> rejoined {rejoined:.2f} s"
    )
