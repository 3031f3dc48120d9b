#!/usr/bin/env python3
"""What one close frame costs the coordinator's event loop with one very large job.

Builds a :class:`~flowsched.coordinator.state.ClusterState` with rmlq (its default arguments)
holding one job of ``--flows`` flows on one node (default 65,536, the most one node may have
open), a class mix of a serving batch (kv with a deadline, size and request; tp; experience
layers), evaluates them all once, then times ``--frames`` close frames of ``--closes`` flows
each: ``close_flows`` plus the ``flush`` it calls for, i.e. what the event loop pays per frame.

Two tables side by side, fed the same frames in turns: "released_affects" (the policy's
hook: a close re-evaluates the flows it names) and the baseline "whole job" (the same policy
behind a wrapper that hides the hook, so a close re-evaluates the rest of the job). Every
flow's level is compared between the two at the end (they must agree). Prints per-frame p50,
p99 and mean for each and the ratio of the means.

Usage:
    .venv/bin/python bench/job_close.py [--flows 65536] [--frames 50] [--closes 1] [--json OUT]

Run it alone: ``flock -x /tmp/flowsched-measure.lock .venv/bin/python bench/job_close.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from flowsched import policies
from flowsched.coordinator.state import ClusterState
from flowsched.model import FlowClass
from flowsched.policies.base import Policy
from flowsched.protocol import FlowClose, FlowOpen, JobProgress

NODE = "n0"
JOB = "batch0"
#: peers whose ingress links the node's flows name (a node sends to a few dozen peers)
PEERS = 32


class HiddenRelease:
    """``policy`` without its ``released_affects``: the callers fall back to the whole job."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy

    def __getattr__(self, name: str) -> Any:
        if name == "released_affects":
            raise AttributeError(name)
        return getattr(self._policy, name)


def opens(count: int, now: float) -> list[FlowOpen]:
    """``count`` opens of one job: half kv (deadline, size, one request per 8), a quarter tp,
    a quarter experience (one layer index each, cycling over 32)."""
    found = []
    for wire_id in range(count):
        links = (f"{NODE}/tx", f"n{1 + wire_id % PEERS}/rx")
        kind = wire_id % 4
        if kind < 2:
            op = FlowOpen(
                wire_id, FlowClass.KV, now, size=4 << 20, deadline=now + 0.5 + wire_id * 1e-6,
                job=JOB, consumer_index=wire_id % 32, request=f"r{wire_id // 8}", links=links,
            )  # fmt: skip
        elif kind == 2:
            op = FlowOpen(wire_id, FlowClass.TP, now, size=1 << 20, job=JOB, links=links)
        else:
            op = FlowOpen(
                wire_id, FlowClass.EXPERIENCE, now, size=2 << 20, job=JOB,
                consumer_index=wire_id % 32, links=links,
            )  # fmt: skip
        found.append(op)
    return found


def build(policy: Policy, count: int, now: float) -> ClusterState:
    """A table with ``count`` flows of one job on one node, all evaluated once."""
    state = ClusterState(policy, default_bandwidth=25e9, max_flows_per_node=count)
    state.job_progress(JobProgress(JOB, 0))
    refused = state.open_flows(NODE, opens(count, now), now)
    if refused:
        raise SystemExit(f"--flows: {refused} of {count} opens refused")
    state.flush(now)
    return state


def time_frames(
    states: dict[str, ClusterState], frames: list[list[int]], start: float, step: float
) -> dict[str, list[float]]:
    """Seconds each close frame cost each table (close_flows + flush), frame i at ``start +
    i * step``; the tables take turns frame by frame (the same machine conditions)."""
    costs: dict[str, list[float]] = {label: [] for label in states}
    for index, wire_ids in enumerate(frames):
        now = start + index * step
        closes = [FlowClose(wire_id, 1 << 20, now) for wire_id in wire_ids]
        for label, state in states.items():
            began = time.perf_counter()
            state.close_flows(NODE, closes, now)
            state.flush(now)
            costs[label].append(time.perf_counter() - began)
    return costs


def summary(costs: list[float]) -> dict[str, float]:
    """p50, p99 and mean of ``costs`` in milliseconds."""
    ordered = sorted(costs)
    return {
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "mean_ms": 1e3 * statistics.fmean(ordered),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 when the two tables' levels disagree."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flows", type=int, default=65536, help="flows of the one job")
    parser.add_argument("--frames", type=int, default=50, help="close frames timed per table")
    parser.add_argument("--closes", type=int, default=1, help="flows each frame closes")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.frames * args.closes > args.flows:
        parser.error("--frames x --closes must not exceed --flows")
    start = 1000.0
    # every 7th wire id from the start: kv, tp and experience flows of many requests
    order = [(i * 7) % args.flows for i in range(args.frames * args.closes)]
    frames = [order[i : i + args.closes] for i in range(0, len(order), args.closes)]
    states = {
        "whole job": build(HiddenRelease(policies.create("rmlq")), args.flows, start),  # type: ignore[arg-type]
        "released_affects": build(policies.create("rmlq"), args.flows, start),
    }
    costs = time_frames(states, frames, start + 1e-3, 1e-4)
    results = {label: summary(found) for label, found in costs.items()}
    for label, figures in results.items():
        print(
            f"{label:>17}: per close frame p50 {figures['p50_ms']:.3f} ms, "
            f"p99 {figures['p99_ms']:.3f} ms, mean {figures['mean_ms']:.3f} ms "
            f"({args.frames} frames of {args.closes} closes, {args.flows} flows)"
        )
    tables = {
        label: {fid: flow.level for fid, flow in state.flows.items()}
        for label, state in states.items()
    }
    ratio = results["whole job"]["mean_ms"] / results["released_affects"]["mean_ms"]
    print(f"whole job / released_affects (means): {ratio:.0f}x")
    same = tables["whole job"] == tables["released_affects"]
    print("levels of every flow agree" if same else "LEVELS DIFFER between the two tables")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "results": results,
                    "ratio": ratio,
                    "same": same,
                }
            )
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
