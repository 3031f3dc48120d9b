"""Wire-level pieces of the benchmarks' simulated agents (bench/coordinator_load.py and
bench/takeover.py): raw msgpack frames, cheap enough to drive 1,000 agents from one core."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Any
from zlib import crc32

import msgpack

from flowsched.protocol import (
    FRAME_MAC_VERSION,
    MIN_PROTOCOL_VERSION,
    PACKED_PROGRESS_VERSION,
    frame,
)

#: the classes of an agent's flows, in order (flow i has class CLASS_MIX[i % len(CLASS_MIX)])
CLASS_MIX = ("tp", "tp", "tp", "experience", "experience", "param_sync", "kv", "kv", "kv", "bulk")
#: the answer to a coordinator's heartbeat
HEARTBEAT = frame(msgpack.packb({"t": "heartbeat", "t_sent": 0.0}))
#: the wire forms of progress reports -> the protocol version a simulated agent offers to
#: send them: "packed" (two integer arrays), "maps" (``{"id", "sent"}`` each, what agents
#: of the previous release send), or "sealed" (packed, in frames that carry MACs, as this
#: release's agents send them)
PROGRESS_FORMS = {
    "packed": PACKED_PROGRESS_VERSION,
    "maps": MIN_PROTOCOL_VERSION,
    "sealed": FRAME_MAC_VERSION,
}


def progress_fields(ids: list[int], sent: list[int], form: str) -> dict[str, Any]:
    """The progress entries of a ``flows`` frame (flow ``ids[i]`` has sent ``sent[i]``
    bytes) in ``form`` (see :data:`PROGRESS_FORMS`)."""
    if form != "maps":
        return {"progress_ids": ids, "progress_sent": sent}
    return {"progress": [{"id": fid, "sent": n} for fid, n in zip(ids, sent, strict=True)]}


def flow_open(
    node: str, wire_id: int, cls: str, now: float, *, kv_deadline_s: float
) -> dict[str, Any]:
    """The wire form of one flow open on ``node`` (an entry of a ``flows`` or ``resync`` frame):
    param_sync flows move 1 GiB within 30 s, kv flows 64 MiB within ``kv_deadline_s``,
    experience flows belong to one of 16 jobs."""
    deadline = size = job = consumer = None
    if cls in ("param_sync", "kv"):
        size = (1 << 30) if cls == "param_sync" else (64 << 20)
        deadline = now + (30.0 if cls == "param_sync" else kv_deadline_s)
    if cls == "experience":
        # a stable job per node (str hash() changes from run to run)
        job, consumer = f"job-{crc32(node.encode()) % 16}", 3
    return {
        "id": wire_id, "cls": cls, "opened_at": now, "sent": 0, "size": size,
        "deadline": deadline, "job": job, "consumer_index": consumer, "request": None,
        "links": [f"{node}:tx"], "level": None,  # its egress, as a real agent names it
    }  # fmt: skip


def prepare_load_generator(cpu: int) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """Set this process up as a benchmark's load generator: SIGTERM (e.g. from ``timeout``)
    unwinds like Ctrl-C, so the coordinator children are stopped; pinned to ``cpu`` where the
    OS allows. Returns the event-loop factory to run it with: uvloop's when it is installed,
    else None (asyncio's default)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {cpu})
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
