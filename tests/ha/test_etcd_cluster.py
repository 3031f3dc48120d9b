"""The election against a real three-member etcd cluster, losing the member in use.

The member killed is etcd's own (raft) leader, listed first in ``--etcd``: the coordinators
talk to it, and the other two must elect a new raft leader before any keepalive succeeds.
With every member listed and the default TTL for several members, a leader keeps its lease
through another member and a standby whose watch died with the member keeps standing by;
with one URL the leader steps down (what listing every member avoids); the first test runs
over http and over https with client certificates. A stopped member keeps its watch streams
open and silent: the standby leaves it by its own reads and takes over once a silenced
leader's lease runs out (tests/ha/test_etcd_partition.py: a partitioned one). End to end: real
coordinators and an agent, the member and then the leading coordinator killed with
``kill -9``. Run with ``-s`` for the times.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from ha_helpers import Daemon, leads, need_etcd, start_agent, start_coordinator, total, wait_for

from flowsched.coordinator.election import CLUSTER_TTL, EtcdElection
from flowsched.protocol import write_token
from flowsched.testbed.daemons import wait_until
from flowsched.testbed.etcd import EtcdCluster, EtcdServerTls, local_etcd_cluster

if TYPE_CHECKING:
    from conftest import TlsFiles

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """Three etcd members on free loopback ports (logs: tmp_path/etcd-i.log)."""
    need_etcd()
    with local_etcd_cluster(3, tmp_path) as members:
        yield members


@pytest.fixture
def tls_cluster(tmp_path: Path, etcd_server_tls: EtcdServerTls) -> Iterator[EtcdCluster]:
    """Three etcd members serving https that require client certificates."""
    need_etcd()
    with local_etcd_cluster(3, tmp_path, etcd_server_tls) as members:
        yield members


def _tls_files(scheme: str, tls: TlsFiles) -> dict[str, str]:
    """EtcdElection's TLS arguments for a cluster of ``scheme``: the CA and client pair of
    tests/conftest.py for https, none for http."""
    if scheme == "http":
        return {}
    return {"cacert": str(tls.ca), "cert": str(tls.client_cert), "key": str(tls.client_key)}


def raft_leader_first(cluster: EtcdCluster) -> tuple[int, str]:
    """The raft leader's index, and every member's URL with the raft leader's first."""
    first = cluster.raft_leader()
    urls = [cluster.urls[first]] + [u for i, u in enumerate(cluster.urls) if i != first]
    return first, ",".join(urls)


@pytest.mark.asyncio
@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_the_leader_and_its_standby_outlive_the_etcd_member_they_use(
    scheme: str, request: pytest.FixtureRequest, tls_files: TlsFiles
) -> None:
    cluster: EtcdCluster = request.getfixturevalue("cluster" if scheme == "http" else "tls_cluster")
    files = _tls_files(scheme, tls_files)
    first, endpoints = raft_leader_first(cluster)
    assert endpoints.startswith(f"{scheme}://")
    leader = EtcdElection(endpoints, "t", "leader:1", lease_ttl=CLUSTER_TTL, **files)
    standby = EtcdElection(endpoints, "t", "standby:1", lease_ttl=CLUSTER_TTL, **files)
    won = await leader.campaign()
    holding = asyncio.ensure_future(leader.hold(won))
    waiting = asyncio.ensure_future(standby.campaign())
    await wait_until(lambda: standby.watching, 5, "the standby to watch the leader key")
    await wait_until(lambda: leader.renewed_at > 0, CLUSTER_TTL, "a first keepalive")

    killed = time.monotonic()
    last_before = leader.renewed_at
    cluster.kill(first)
    renewed = await wait_until(lambda: leader.renewed_at > killed, CLUSTER_TTL, "a renewal")
    assert leader.url != cluster.urls[first]
    assert not holding.done(), "the leader stepped down although two members live"
    await wait_until(lambda: standby.url != cluster.urls[first], 2 * CLUSTER_TTL, "the standby")
    assert not waiting.done(), "the standby took over from a live leader"
    assert standby.leader is not None and standby.leader.epoch == won.epoch

    holding.cancel()
    resigned = time.monotonic()
    await leader.resign(won)  # through a live member: the standby's watch sees it
    taken = await asyncio.wait_for(waiting, 5)
    handover = time.monotonic() - resigned
    assert taken.epoch > won.epoch and taken.cluster == won.cluster
    print(
        f"\nraft leader killed: the lease renewed through another member {renewed:.2f} s "
        f"later ({leader.renewed_at - last_before:.2f} s after the previous renewal); "
        f"handover after resign: {handover * 1e3:.0f} ms"
    )


@pytest.mark.asyncio
async def test_with_only_the_member_in_use_listed_the_leader_steps_down(
    cluster: EtcdCluster,
) -> None:
    first = cluster.raft_leader()
    leader = EtcdElection(cluster.urls[first], "t", "leader:1", lease_ttl=2)
    won = await leader.campaign()
    holding = asyncio.ensure_future(leader.hold(won))
    await wait_until(lambda: leader.renewed_at > 0, 2, "a first keepalive")
    cluster.kill(first)
    await asyncio.wait_for(holding, 4)  # no keepalive for 1.5 s: it gives up
    survivor = next(u for i, u in enumerate(cluster.urls) if i != first)
    taken = await asyncio.wait_for(EtcdElection(survivor, "t", "b:1").campaign(), 15)
    assert taken.epoch > won.epoch


@pytest.mark.asyncio
async def test_a_standby_leaves_a_hung_member_and_takes_over_when_the_lease_expires(
    cluster: EtcdCluster,
) -> None:
    """A stopped member keeps its watch streams open and silent: the standby must notice by
    its own reads, or it would learn of the leader's expired lease only much later."""
    ttl = 3
    raft = cluster.raft_leader()
    hung = next(i for i in range(3) if i != raft)  # a follower: no raft election follows
    others = [url for i, url in enumerate(cluster.urls) if i != hung]
    endpoints = ",".join([cluster.urls[hung], *others])
    leader = EtcdElection(endpoints, "t", "leader:1", lease_ttl=ttl)
    standby = EtcdElection(endpoints, "t", "standby:1", lease_ttl=ttl)
    won = await leader.campaign()
    holding = asyncio.ensure_future(leader.hold(won))
    waiting = asyncio.ensure_future(standby.campaign())
    await wait_until(lambda: standby.watching, 5, "the standby to watch the leader key")
    cluster.signal(hung, signal.SIGSTOP)
    try:
        await wait_until(lambda: standby.url != cluster.urls[hung], ttl, "the standby to move")
        await wait_until(lambda: standby.watching, ttl, "a watch on another member")
        assert not waiting.done() and not holding.done()
        holding.cancel()  # the leader goes silent, as a hung host does: its lease runs out
        silent = time.monotonic()
        taken = await asyncio.wait_for(waiting, 5 * ttl)
        took = time.monotonic() - silent
    finally:
        cluster.signal(hung, signal.SIGCONT)
    assert taken.epoch > won.epoch
    # the lease ends TTL after the last keepalive, plus etcd's expiry scan (up to 0.5 s); a
    # watch left on the hung member would have waited for a re-read (five TTLs before)
    assert took < 2 * ttl, took
    print(f"\nleader silent -> standby leads: {took:.2f} s (TTL {ttl} s)")


def test_kill9_of_the_etcd_member_in_use_then_of_the_leader(
    tmp_path: Path, cluster: EtcdCluster
) -> None:
    token = tmp_path / "token"
    write_token(token)
    first, endpoints = raft_leader_first(cluster)
    coordinators: list[Daemon] = []
    agent: Daemon | None = None
    try:
        coordinators += [
            start_coordinator(tmp_path, token, endpoints, f"coord{i}") for i in range(2)
        ]
        wait_for(lambda: any(leads(c) for c in coordinators), 15, "a leader")
        leader = next(c for c in coordinators if leads(c))
        agent = start_agent(tmp_path, token, coordinators, "n0")
        wait_for(lambda: _serves(leader), 15, "the agent on the leader")

        log = tmp_path / f"{leader.name}.log"
        moved_on = f"etcd {cluster.urls[first]} failed ("  # (then: "trying <the next one>")
        cluster.kill(first)  # the member both coordinators use, and etcd's raft leader
        moved = wait_for(lambda: moved_on in log.read_text(), CLUSTER_TTL, "the next member")
        assert leads(leader) and leader.proc.poll() is None
        counted = f'flowsched_coordinator_etcd_failures_total{{member="{cluster.urls[first]}"}}'
        assert leader.metrics()[counted] >= 1
        assert _serves(leader), "the agent left a leader that kept its lease"

        killed = time.monotonic()
        leader.kill9()
        successor = next(c for c in coordinators if c is not leader)
        wait_for(lambda: leads(successor), 15, "the standby to lead")
        took_over = time.monotonic() - killed
        wait_for(lambda: _serves(successor), 15, "the agent on the new leader")
        back = time.monotonic() - killed
        print(
            f"\netcd's raft leader killed: the leader turned to another member within "
            f"{moved:.2f} s; then kill -9 of the leader: a standby leads after "
            f"{took_over * 1e3:.0f} ms, the agent is back after {back * 1e3:.0f} ms"
        )
    finally:
        for daemon in [*coordinators, *([agent] if agent else [])]:
            daemon.stop()


def _serves(coordinator: Daemon) -> bool:
    return total(coordinator.metrics(), "flowsched_coordinator_agents_connected") == 1
