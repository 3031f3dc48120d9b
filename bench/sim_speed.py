"""Simulator speed benchmark: a 256-node x 8-NIC cluster with >= 100,000 flows.

Workload (seeded): the cluster is cut into jobs of ``--job-nodes`` nodes. Each job runs
``--rounds`` rounds of compute followed by a rail-aligned ring collective (NIC k of node i sends
to NIC k of node i+1 of its job; the next round waits for the whole collective), like TP/DP
traffic on a rail-optimized fabric. On top, Poisson point-to-point transfers between random
NICs of random nodes (KV/param-sync-like) couple the jobs' links.

Each measurement runs in its own process (so peak RSS is its own) on one core:

* ``incremental``: the engine as shipped (rates recomputed only for the touched component,
  only at the touched level and below);
* ``naive``: the same engine with a straightforward full recomputation of every active flow at
  every event, the baseline. It is run on a reduced cluster (``--naive-nodes``) because it is
  too slow for the full one; ``incremental`` is run on that reduced cluster too, and the ratio
  of the two is reported.

Usage: ``python bench/sim_speed.py [--nodes 256] [--nics 8] [--rounds 49] [--policy fair]``.
Targets: full cluster >= 100,000 flows in <= 60 s and < 2 GiB peak RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from typing import Any

from flowsched.model import FlowClass
from flowsched.policies import create
from flowsched.sim.engine import ActiveFlow, SimConfig, Simulator
from flowsched.sim.topology import NodeGroup, Topology


class NaiveSimulator(Simulator):
    """Baseline: every flush recomputes every active flow on every link (no locality)."""

    def _component(self) -> tuple[list[ActiveFlow], set[int]]:
        self._dirty_level = 0.0
        links = {link for state in self.active.values() for link in state.links}
        return list(self.active.values()), links


def build(args: argparse.Namespace, nodes: int, naive: bool) -> tuple[Simulator, int]:
    """The simulator with the workload scheduled; returns it and the number of flows planned."""
    topo = Topology.build([NodeGroup("n", nodes, args.nics, 200.0)])
    cls = NaiveSimulator if naive else Simulator
    sim = cls(
        topo.capacity,
        create(args.policy, num_levels=8),
        SimConfig(timer_period=args.timer_ms / 1e3),
    )
    rng = random.Random(args.seed)
    planned = 0
    for job in range(nodes // args.job_nodes):
        members = [f"n{job * args.job_nodes + i}" for i in range(args.job_nodes)]
        planned += _ring_job(sim, topo, members, args, rng)
    planned += _background(sim, topo, nodes, args, rng)
    return sim, planned


def _ring_job(
    sim: Simulator, topo: Topology, members: list[str], args: argparse.Namespace, rng: random.Random
) -> int:
    size = int(args.ring_mb * 1e6)
    job = members[0]

    def round_(index: int) -> None:
        if index >= args.rounds:
            return
        left = [len(members) * args.nics]
        sim.set_job_index(job, index)

        def done(_flow: object) -> None:
            left[0] -= 1
            if left[0] == 0:
                sim.after(args.compute_ms / 1e3 * rng.uniform(0.8, 1.2), lambda: round_(index + 1))

        for i, src in enumerate(members):
            dst = members[(i + 1) % len(members)]
            for nic in range(args.nics):
                sim.open_flow(
                    FlowClass.TP,
                    size,
                    topo.path(src, nic, dst, nic),
                    done,
                    job=job,
                    consumer_index=index,
                )

    sim.at(rng.uniform(0, args.compute_ms / 1e3), lambda: round_(0))
    return args.rounds * len(members) * args.nics


def _background(
    sim: Simulator, topo: Topology, nodes: int, args: argparse.Namespace, rng: random.Random
) -> int:
    now, count = 0.0, int(args.background * nodes / 256)
    for _ in range(count):
        now += rng.expovariate(args.background_rate * nodes / 256)
        src, dst = rng.sample(range(nodes), 2)
        links = topo.path(f"n{src}", rng.randrange(args.nics), f"n{dst}", rng.randrange(args.nics))
        size = int(rng.lognormvariate(16, 1.0))
        sim.at(now, lambda p=links, s=size: sim.open_flow(FlowClass.KV, s, p))
    return count


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this process."""
    started = time.perf_counter()
    sim, planned = build(args, args.child_nodes, args.child == "naive")
    sim.run()
    wall = time.perf_counter() - started
    flows = len(sim.records.flows)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "mode": args.child,
        "nodes": args.child_nodes,
        "flows": flows,
        "planned": planned,
        "wall_s": round(wall, 3),
        "flows_per_s": round(flows / wall),
        "peak_rss_mib": round(rss / 2**20, 1),
        "sim_time_s": round(sim.now, 4),
        "events": sim.events_processed,
    }


def measure(mode: str, nodes: int, argv: list[str]) -> dict[str, Any]:
    """Run one measurement in a fresh single-threaded process."""
    cmd = [sys.executable, __file__, *argv, "--child", mode, "--child-nodes", str(nodes)]
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--nics", type=int, default=8)
    parser.add_argument("--job-nodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=45)
    parser.add_argument("--ring-mb", type=float, default=64.0)
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--background", type=int, default=12_000, help="p2p flows on 256 nodes")
    parser.add_argument("--background-rate", type=float, default=40_000.0, help="per s, 256 nodes")
    parser.add_argument("--policy", default="fair")
    parser.add_argument("--timer-ms", type=float, default=1.0)
    parser.add_argument("--naive-nodes", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--child", choices=["incremental", "naive"], help=argparse.SUPPRESS)
    parser.add_argument("--child-nodes", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    small_inc = measure("incremental", args.naive_nodes, argv)
    small_naive = measure("naive", args.naive_nodes, argv)
    full = measure("incremental", args.nodes, argv)
    print(
        f"{'mode':12} {'nodes':>5} {'flows':>8} {'wall s':>8} {'flows/s':>9} {'peak RSS MiB':>12}"
    )
    for row in (small_naive, small_inc, full):
        print(
            f"{row['mode']:12} {row['nodes']:>5} {row['flows']:>8} {row['wall_s']:>8.2f} "
            f"{row['flows_per_s']:>9} {row['peak_rss_mib']:>12}"
        )
    ratio = small_naive["wall_s"] / small_inc["wall_s"]
    print(
        f"speed-up of incremental over naive full recomputation "
        f"({args.naive_nodes} nodes): {ratio:.1f}x"
    )
    ok = full["flows"] >= 100_000 and full["wall_s"] <= 60 and full["peak_rss_mib"] < 2048
    print(
        f"target (>= 100000 flows, <= 60 s, < 2048 MiB) on {args.nodes} x {args.nics} NICs: "
        f"{'met' if ok else 'NOT met'}"
    )
    print(
        json.dumps(
            {"naive": small_naive, "incremental_small": small_inc, "full": full, "ratio": ratio}
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
