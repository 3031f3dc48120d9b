"""What one node's flows cost the coordinator's memory, within its bounds (docs/security.md).

Each shape runs in a fresh interpreter: a ``ClusterState`` with rmlq (the coordinator's state
and policy, in process, no network), then opens of one node name fed in batches of 200 (an
agent's most per frame; each batch is dropped once admitted, as a decoded frame is), every
name a new string as a decoded frame gives. Reported: the flows kept, the resident memory
before and after (``/proc/self/status``, after a full collection), and the added memory per
flow kept.

Shapes:
* ``real``: each flow names its node's egress and one of 1,000 peers' ingress, one of 16 jobs,
  four flows per request (the pd-serving and training traces' shape);
* ``costliest``: the most the bounds let a node's flows name: 4 links per flow out of 16,384
  names, 4,096 jobs, a request per flow, every name 240-255 four-byte characters;
* ``invented``: a token holder's flows, each naming 63 invented ~250-character links, a
  255-character job and a request of its own (the bounds refuse most of them).

``--flows`` is the opens sent per shape (default 65,534, within the coordinator's per-node
flow cap). One shape takes 10-60 s of one core.

    .venv/bin/python bench/coordinator_memory.py [--shapes real,costliest,invented] [--flows N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from flowsched.coordinator.state import ClusterState
from flowsched.model import FlowClass
from flowsched.policies import create
from flowsched.protocol import FlowOpen
from flowsched.testbed.procstat import memory_mib

NODE = "n1"
BATCH = 200


def fresh(text: str) -> str:
    """``text`` as a new string object (a decoded frame gives one per name)."""
    return "".join(list(text))


def wide_name(index: int, length: int) -> str:
    """A name of ``length`` four-byte characters, distinct per ``index``."""
    digits = f"-{index}"
    return chr(0x1F600) * (length - len(digits)) + digits


def real(i: int) -> tuple[tuple[str, ...], str, str]:
    """Open ``i``'s links, job and request in the ``real`` shape (see the module docstring)."""
    return (f"{NODE}:tx", f"peer{i % 1000}:rx"), f"job-{i % 16}", f"job-{i % 16}/r{i // 4}"


def costliest(i: int) -> tuple[tuple[str, ...], str, str]:
    links = tuple(wide_name((4 * i + k) % 16384, 240 + (4 * i + k) % 16) for k in range(4))
    return links, wide_name(i % 4096, 255), wide_name(i, 255)


def invented(i: int) -> tuple[tuple[str, ...], str, str]:
    links = tuple(f"{'x' * 240}-{i}-{k}:rx" for k in range(63))
    return links, "j" * 250 + f"{i:05d}", f"r-{i}"


SHAPES: dict[str, Callable[[int], tuple[tuple[str, ...], str, str]]] = {
    "real": real,
    "costliest": costliest,
    "invented": invented,
}


def batches(shape: str, flows: int) -> Iterator[list[FlowOpen]]:
    names = SHAPES[shape]
    now = time.time()
    for first in range(0, flows, BATCH):
        batch = []
        for i in range(first, min(first + BATCH, flows)):
            links, job, request = names(i)
            links = tuple(fresh(link) for link in links)
            opened = FlowOpen(i, FlowClass.KV, now, size=1 << 20, deadline=now + 1.0, links=links)
            batch.append(replace(opened, job=fresh(job), request=fresh(request)))
        yield batch


def measure(shape: str, flows: int) -> dict[str, float | int | str]:
    """Open ``flows`` flows of ``shape`` into a fresh state; what it kept and what it cost."""
    state = ClusterState(create("rmlq"))
    gc.collect()
    before = memory_mib(os.getpid())[0]
    refused = 0
    for batch in batches(shape, flows):
        refused += state.open_flows(NODE, batch, time.time())
    gc.collect()
    after = memory_mib(os.getpid())[0]
    kept = len(state.by_node.get(NODE, {}))
    per_flow = (after - before) * 1024 / kept if kept else float("nan")
    return {"shape": shape, "sent": flows, "kept": kept, "refused": refused,
            "rss_before_mib": round(before, 1), "rss_after_mib": round(after, 1),
            "kib_per_flow": round(per_flow, 2)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: %(default)s")
    parser.add_argument("--flows", type=int, default=65534, help="opens sent per shape")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.flows)))
        return 0
    if args.flows < 1:
        parser.error(f"--flows: at least 1, got {args.flows}")
    shapes = args.shapes.split(",")
    unknown = [shape for shape in shapes if shape not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}, choose from {', '.join(SHAPES)}")
    print("| shape | opens | kept | refused | RSS before -> after (MiB) | KiB per flow kept |")
    print("|---|---|---|---|---|---|")
    for shape in shapes:
        out = subprocess.run(
            [sys.executable, __file__, "--child", shape, "--flows", str(args.flows)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        row = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {shape} | {row['sent']:,} | {row['kept']:,} | {row['refused']:,} | "
            f"{row['rss_before_mib']} -> {row['rss_after_mib']} | {row['kib_per_flow']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
