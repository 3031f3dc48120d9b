"""A live leader that the network cuts off from the agents but not from etcd (netns testbed).

etcd runs on h0, the leader on h1, the standby on h2 and an agent on h3, each in its host's
network namespace, all on the testbed's management network. Once the agent follows the
leader, blackhole routes cut h1 and h3 off from each other (both stay up; etcd reaches both
coordinators). The agent falls back to its local policy and knocks on the standby; the leader's
session with it times out, so it publishes that it serves no agent; the standby deposes it
and leads; the agent follows the standby; the deposed leader exits. Run with ``-s`` for the
times.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ha_helpers import etcd_testbed, wait_for

from flowsched.protocol import write_token
from flowsched.testbed import netns
from flowsched.testbed.daemons import Daemon, spawn
from flowsched.testbed.etcd import etcd_cluster_in_namespaces

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(180)]

DEADLINE = 30.0
_COORDINATOR_READY = r"listening on (?P<host>[\d.]+):(?P<port>\d+) metrics"
_AGENT_READY = r"ready node=(?P<node>\S+)"


@pytest.fixture
def topo() -> Iterator[netns.Topology]:
    """Four testbed hosts: etcd on h0, coordinators on h1 and h2, an agent on h3."""
    with etcd_testbed("fsL-", 4) as built:
        yield built


def _cut(topo: netns.Topology, a: int, b: int) -> None:
    """Hosts ``a`` and ``b`` drop what they send each other (blackhole routes)."""
    hosts = topo.hosts
    for here, there in ((hosts[a], hosts[b]), (hosts[b], hosts[a])):
        route = ["ip", "-n", here.netns, "route", "add", "blackhole", f"{there.mgmt_ip}/32"]
        subprocess.run(route, check=True, capture_output=True)


def _coordinator(topo: netns.Topology, host: int, etcd: str, token: Path, tmp: Path) -> Daemon:
    name = f"c{host}"
    inside = topo.ns_command(topo.hosts[host].netns, [])
    return spawn(
        name,
        ["coordinator", "--listen", f"{topo.hosts[host].mgmt_ip}:0", "--metrics-port", "0",
         "--token-file", str(token), "--etcd", etcd, "--election-name", "cut", "--log-level",
         "INFO"],
        tmp / f"{name}.log", _COORDINATOR_READY, wrapper=inside,
    )  # fmt: skip


def _sessions(log: Path) -> list[int]:
    """The epochs of the agent's coordinator sessions, in order."""
    found = re.findall(r"connected to the coordinator \(epoch (\d+)\)", log.read_text())
    return [int(epoch) for epoch in found]


def test_the_standby_the_agents_reach_deposes_a_leader_cut_off_from_them(
    topo: netns.Topology, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    write_token(token)
    started: list[Daemon] = []
    with etcd_cluster_in_namespaces([(topo.hosts[0].netns, topo.hosts[0].mgmt_ip)], tmp_path) as [
        etcd
    ]:
        try:
            leader = _coordinator(topo, 1, etcd, token, tmp_path)
            started.append(leader)
            wait_for(lambda: "elected leader" in (tmp_path / "c1.log").read_text(), DEADLINE,
                     "c1 to lead")  # fmt: skip
            standby = _coordinator(topo, 2, etcd, token, tmp_path)
            started.append(standby)
            wait_for(lambda: "standby:" in (tmp_path / "c2.log").read_text(), DEADLINE,
                     "c2 to stand by")  # fmt: skip
            addresses = ",".join(
                f"{c.fields['host']}:{c.fields['port']}" for c in (leader, standby)
            )
            agent_log = tmp_path / "agent.log"
            agent = spawn(
                "agent",
                ["agent", "--coordinator", addresses, "--node", "n3", "--token-file", str(token),
                 "--table", str(tmp_path / "n3.table"), "--socket", str(tmp_path / "n3.sock"),
                 "--slots", "16", "--metrics-port", "0", "--interface", "lo", "--log-level",
                 "INFO"],
                agent_log, _AGENT_READY, wrapper=topo.ns_command(topo.hosts[3].netns, []),
            )  # fmt: skip
            started.append(agent)
            wait_for(lambda: len(_sessions(agent_log)) == 1, DEADLINE, "the agent on c1")
            [first] = _sessions(agent_log)

            _cut(topo, 1, 3)
            cut = time.monotonic()
            wait_for(lambda: len(_sessions(agent_log)) == 2, 60, "the agent on the new leader")
            back = time.monotonic() - cut
            assert _sessions(agent_log)[1] > first  # a new leadership, not c1's again
            assert leader.proc.wait(timeout=DEADLINE) == 1  # its lease gone: it exited
            exited = time.monotonic() - cut
            said = (tmp_path / "c2.log").read_text()
            assert f"deposing the leader at {leader.fields['host']}:{leader.fields['port']}" in said
            assert ": 1 (n3); it serves 0" in said
            print(f"\nleader cut off from the agent: the agent under the standby {back:.2f} s "
                  f"after the cut (the old leader exited after {exited:.2f} s)")  # fmt: skip
        finally:
            for daemon in reversed(started):
                daemon.stop()
