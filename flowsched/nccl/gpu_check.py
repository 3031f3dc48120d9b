"""The evidence behind ``bench/gpu/allreduce_check.py``: did NCCL move a run's bytes through us?

Pure functions over what a run leaves behind (each rank's NCCL log and the flow table the
run created), so that the assertions are tested without a GPU:

* :func:`channel_transports` / :func:`check_channels`: every ``Channel ... via X`` line NCCL
  printed names ``NET/flowsched`` (no P2P, SHM or another network carried a channel);
* :func:`comm_ids`: the commIds NCCL logged (``commId 0x...`` on its init lines), in order;
* :func:`check_slots`: each rank's pid owns send and receive slots with each commId, their
  byte counts cover what the rank had to send and receive for the operations it ran, and a
  group's slots carry the flow class it was created for.

The log formats are NCCL's (2.27+; the reference lists them); a missing line is a failure,
never a pass.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flowsched.shm import layout
from flowsched.shm.table import SlotSnapshot

_CHANNEL = re.compile(r"Channel \d+/\d+ : .*? via (\S+)")
_COMM_ID = re.compile(r"commId (0x[0-9a-fA-F]+)")


@dataclass(frozen=True, slots=True)
class Slot:
    """The fields of a flow-table slot the check reads."""

    pid: int
    comm_id: int
    direction: int
    class_id: int
    bytes: int


@dataclass(frozen=True, slots=True)
class CommExpectation:
    """What one communicator of one rank must show: its class and a byte floor per direction."""

    label: str
    class_id: int
    min_bytes: int


def channel_transports(log_text: str) -> list[str]:
    """The transport of every channel line (``NET/flowsched/0``, ``P2P/IPC``...)."""
    return _CHANNEL.findall(log_text)


def check_channels(log_text: str, net_name: str = "flowsched") -> list[str]:
    """Problems with a rank's channel lines: none at all, or one not through ``net_name``."""
    transports = channel_transports(log_text)
    if not transports:
        return ["no 'Channel ... via' line in the NCCL log (NCCL_DEBUG=INFO missing?)"]
    prefix = f"NET/{net_name}"
    return [f"a channel went via {t}, not {prefix}" for t in transports if not t.startswith(prefix)]


def comm_ids(log_text: str) -> list[int]:
    """The distinct commIds in a rank's log, in the order NCCL first printed them."""
    seen: list[int] = []
    for text in _COMM_ID.findall(log_text):
        value = int(text, 16)
        if value not in seen:
            seen.append(value)
    return seen


def slots_from_table(rows: Iterable[SlotSnapshot]) -> list[Slot]:
    """Slots (not FREE) from ``flowsched.shm.table.FlowTable.slots()`` snapshots."""
    return [
        Slot(r.pid, r.comm_id, r.direction, r.class_id, r.bytes)
        for r in rows
        if r.state != layout.SLOT_FREE
    ]


def check_slots(
    slots: Sequence[Slot], pid: int, expected: Mapping[int, CommExpectation]
) -> list[str]:
    """Problems with one rank's slots: ``expected`` maps each commId to what its slots owned by
    ``pid`` must show (both directions present, the class, bytes at least the floor)."""
    problems = []
    for comm_id, want in expected.items():
        mine = [s for s in slots if s.pid == pid and s.comm_id == comm_id]
        for direction, name in ((layout.DIR_SEND, "send"), (layout.DIR_RECV, "receive")):
            chosen = [s for s in mine if s.direction == direction]
            where = f"{want.label} (commId {comm_id:#x}) of pid {pid}"
            if not chosen:
                problems.append(f"no {name} slot for {where}")
                continue
            total = sum(s.bytes for s in chosen)
            if total < want.min_bytes:
                problems.append(
                    f"{name} slots of {where} counted {total} bytes, "
                    f"less than the {want.min_bytes} the operations moved"
                )
            classes = {s.class_id for s in chosen}
            if classes != {want.class_id}:
                problems.append(
                    f"{name} slots of {where} have class {sorted(classes)}, "
                    f"expected {want.class_id}"
                )
    return problems


def allreduce_floor(nbytes: int, nranks: int = 2) -> int:
    """Bytes each rank must send (and receive) for an all_reduce of ``nbytes``: a ring sends
    2(n-1)/n of the buffer; a 2-rank tree sends the whole buffer once each way."""
    return 2 * (nranks - 1) * nbytes // nranks


def alltoall_floor(nbytes: int, nranks: int = 2) -> int:
    """Bytes each rank sends (and receives) in an all_to_all of ``nbytes`` per rank."""
    return (nranks - 1) * nbytes // nranks
