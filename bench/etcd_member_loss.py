#!/usr/bin/env python3
"""etcd member loss: does an elected coordinator keep its leadership when the etcd member it
talks to dies, and how long are its keepalives interrupted, for each lease TTL side by side.

Each run starts a three-member etcd cluster on loopback (Debian's ``etcd-server``, as
:func:`flowsched.testbed.etcd.local_etcd_cluster`), elects one candidate
(:class:`flowsched.coordinator.election.EtcdElection`, the coordinator's own code) with every
member's URL and etcd's own (raft) leader listed first, waits a random part of a keepalive
period, then stops that member (``kill``: ``kill -9``; ``stop``: SIGSTOP, a hung member whose
connections stay open). The others must elect a new raft leader before any keepalive
succeeds. Per TTL it reports how many runs kept the leadership and the time between the last
keepalive that etcd answered before the loss and the first after it (the leader steps down
once that reaches 0.75 TTL); a run that lost it, when it stepped down. docs/ha.md has the
figures::

    .venv/bin/python bench/etcd_member_loss.py --ttls 2,3,5,10 --runs 8 --how kill,stop

Run it under ``flock -x /tmp/flowsched-measure.lock`` on a shared machine: the raft election
is CPU-bound and slows on a busy one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import statistics
import sys
import time

from flowsched.coordinator.election import EtcdElection
from flowsched.testbed.etcd import etcd_binary, local_etcd_cluster

#: seconds a run waits for the lost member's successor before calling the leadership lost
SETTLE_TTLS = 3


async def one_run(ttl: int, how: str) -> tuple[bool, float]:
    """(kept, gap between renewals) or (lost, seconds from the loss to the step-down)."""
    with local_etcd_cluster(3) as cluster:
        first = cluster.raft_leader()
        urls = [cluster.urls[first]] + [u for i, u in enumerate(cluster.urls) if i != first]
        election = EtcdElection(",".join(urls), "bench", "leader:1", lease_ttl=ttl)
        holding = asyncio.ensure_future(election.hold(await election.campaign()))
        while election.renewed_at == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(random.uniform(0, ttl / 4))  # any phase of the keepalive period
        before, lost_at = election.renewed_at, time.monotonic()
        if how == "kill":
            cluster.kill(first)
        else:
            cluster.signal(first, signal.SIGSTOP)
        deadline = lost_at + SETTLE_TTLS * ttl
        while not holding.done() and election.renewed_at <= lost_at:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        if holding.done() or election.renewed_at <= lost_at:
            holding.cancel()
            return False, time.monotonic() - lost_at
        holding.cancel()
        return True, election.renewed_at - before


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ttls", default="2,3,5,10", help="lease TTLs, whole seconds")
    parser.add_argument("--runs", type=int, default=8, help="runs per TTL and way of loss")
    parser.add_argument("--how", default="kill,stop", help="kill (-9) and/or stop (SIGSTOP)")
    parser.add_argument("--seed", type=int, default=1, help="for the phase of each loss")
    args = parser.parse_args()
    if etcd_binary() is None:
        print("etcd is not installed (Debian: apt-get install etcd-server)", file=sys.stderr)
        return 1
    random.seed(args.seed)
    logging.basicConfig(level=logging.CRITICAL)  # the election's warnings are expected here
    print("| TTL s | member | kept | gap between renewals, s (min / median / max) | lost after |")
    print("|---|---|---|---|---|")
    for how in args.how.split(","):
        for ttl in (int(t) for t in args.ttls.split(",")):
            results = [await one_run(ttl, how) for _ in range(args.runs)]
            gaps = [value for kept, value in results if kept]
            lost = [f"{value:.2f}" for kept, value in results if not kept]
            spread = (
                f"{min(gaps):.2f} / {statistics.median(gaps):.2f} / {max(gaps):.2f}"
                if gaps else "-"
            )  # fmt: skip
            verb = "killed" if how == "kill" else "stopped"
            print(
                f"| {ttl} | {verb} | {len(gaps)} of {len(results)} | {spread} |"
                f" {', '.join(lost) or '-'} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
