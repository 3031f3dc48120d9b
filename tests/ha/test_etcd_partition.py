"""The election through a three-member etcd whose member in use is cut off from the others.

Each member runs in a host namespace of the netns testbed; the election (a leader and a
standby, tests/ha/partition_client.py) runs in a fourth. The cut is a partition, not a crash:
blackhole routes between the follower and the other members, while the election's host still
reaches all three. The follower stays up and keeps its connections, so the standby's watch on
it stays open and silent; the standby must find that out by itself (its reads of the key fail,
a linearizable read needing etcd's quorum) and take over when the silenced leader's lease runs
out. Run with ``-s`` for the times.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ha_helpers import etcd_testbed

from flowsched.testbed import netns
from flowsched.testbed.etcd import etcd_cluster_in_namespaces

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(120)]

TTL = 3
CLIENT = Path(__file__).with_name("partition_client.py")


@pytest.fixture
def topo() -> Iterator[netns.Topology]:
    """Four testbed hosts: etcd members on h0-h2, the election on h3."""
    with etcd_testbed("fsH-", 4) as built:
        yield built


def cut_off(topo: netns.Topology, member: int, members: int) -> None:
    """Partition member ``member`` from the other members: each side drops what it sends to
    the other (blackhole routes); the other hosts still reach it."""
    hosts = topo.hosts[:members]
    for other in (h for h in hosts if h.index != member):
        for here, there in ((hosts[member], other), (other, hosts[member])):
            route = ["ip", "-n", here.netns, "route", "add", "blackhole", f"{there.mgmt_ip}/32"]
            subprocess.run(route, check=True, capture_output=True)


def _read(proc: subprocess.Popen[str], logs: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        tails = "\n".join(p.read_text()[-1500:] for p in sorted(logs.glob("etcd-*.log")))
        raise AssertionError(f"the election side exited ({proc.returncode}); etcd logs:\n{tails}")
    found: dict[str, Any] = json.loads(line)
    return found


def test_a_partitioned_member_costs_neither_the_leadership_nor_the_takeover(
    topo: netns.Topology, tmp_path: Path
) -> None:
    members = [(host.netns, host.mgmt_ip) for host in topo.hosts[:3]]
    with etcd_cluster_in_namespaces(members, tmp_path) as urls:
        argv = [sys.executable, str(CLIENT), ",".join(urls), str(TTL)]
        proc = subprocess.Popen(
            topo.ns_command(topo.hosts[3].netns, argv),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            ready = _read(proc, tmp_path)
            assert ready["standby_url"] == urls[ready["cut"]]  # its watch is on that member
            cut_off(topo, ready["cut"], len(members))
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            done = _read(proc, tmp_path)
        finally:
            proc.kill()
            proc.wait()
    print(f"\npartition: {done}")
    assert done["kept"], "the leader lost its leadership or the standby took it while it lived"
    assert done["leader_renewed"] is not None, "no keepalive got through another member"
    # the standby left the cut-off member (its watch there would never have fired) ...
    assert done["standby_moved"] is not None and done["standby_moved"] < TTL, done
    # ... and took over when the silenced leader's lease ran out: TTL after its last
    # keepalive, plus etcd's expiry scan (up to 0.5 s)
    assert done["took"] is not None and done["took"] < 2 * TTL, done
    assert done["epochs"][1] > done["epochs"][0]
