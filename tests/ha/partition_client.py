"""The election side of tests/ha/test_etcd_partition.py, run inside a testbed host's network
namespace (where the etcd members are reachable): ``python partition_client.py URLS TTL``.

It waits for the cluster's raft leader, names a follower to cut off (stdout, one JSON object
per line), elects a leader and a standby that list that follower first, waits for ``go`` on
stdin (the follower is cut off from the other members by then, still reachable from here),
lets the leader's keepalives and the standby's watch move on, then silences the leader (no
resign: its lease runs out) and reports when the standby took over.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable

from flowsched.coordinator.election import EtcdElection
from flowsched.testbed.daemons import wait_until
from flowsched.testbed.etcd import EtcdCluster


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def raft_leader(urls: list[str], timeout: float) -> int:
    """The member leading etcd's raft, once a quorum has formed."""
    end = time.monotonic() + timeout
    while True:
        try:
            return EtcdCluster(urls, []).raft_leader()
        except RuntimeError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


async def seconds_until(predicate: Callable[[], object], timeout: float) -> float | None:
    """Seconds until ``predicate()`` held; None when ``timeout`` passed first."""
    try:
        return await wait_until(predicate, timeout, "")
    except AssertionError:
        return None


async def main(urls: list[str], ttl: int) -> None:
    raft = raft_leader(urls, 30)
    cut = next(i for i in range(len(urls)) if i != raft)  # a follower: no raft election
    endpoints = ",".join([urls[cut], *(u for i, u in enumerate(urls) if i != cut)])
    leader = EtcdElection(endpoints, "t", "leader:1", lease_ttl=ttl)
    standby = EtcdElection(endpoints, "t", "standby:1", lease_ttl=ttl)
    won = await leader.campaign()
    holding = asyncio.ensure_future(leader.hold(won))
    waiting = asyncio.ensure_future(standby.campaign())
    await seconds_until(lambda: standby.watching and leader.renewed_at > 0, 5 * ttl)
    say(event="ready", cut=cut, standby_url=standby.url, leader_url=leader.url)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    cut_at = time.monotonic()
    moved = await seconds_until(lambda: standby.url != urls[cut] and standby.watching, 3 * ttl)
    # a renewal sent a TTL after the cut: past the 0.75 TTL a leader waits before stepping down
    renewed = await seconds_until(lambda: leader.renewed_at > cut_at + ttl, 3 * ttl)
    kept = not holding.done() and not waiting.done()
    holding.cancel()  # the leader goes silent, as a hung host does
    silent = time.monotonic()
    try:
        taken = await asyncio.wait_for(waiting, 10 * ttl)
    except TimeoutError:
        took, epochs = None, [won.epoch]
    else:
        took, epochs = time.monotonic() - silent, [won.epoch, taken.epoch]
    say(event="done", standby_moved=moved, leader_renewed=renewed, kept=kept, took=took,
        epochs=epochs, leader_url=leader.url, standby_url=standby.url,
        failures=leader.failures)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1].split(","), int(sys.argv[2])))
