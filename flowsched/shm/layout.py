"""Byte layout of the node's shared-memory flow table: the one place it is written down.

The agent creates the table (a file in its runtime directory, /run/flowsched by default, mode
0600 or 0660 with a configured group) and the NCCL plugin (``nccl_plugin/src/flow_table.h``
mirrors these numbers; a test compares them field by field) maps it into every training or
serving process. All integers are
little-endian and naturally aligned, so that each field is read or written with one plain load
or store.

Header (``HEADER_SIZE`` = 4096 bytes, at offset 0)::

    off  size  type      field            writer  meaning
    0    4     u32       magic            agent   MAGIC (b"FSFT" as little-endian u32)
    4    4     u32       version          agent   VERSION; readers refuse other versions
    8    4     u32       header_size      agent   4096
    12   4     u32       slot_size        agent   128
    16   4     u32       num_slots        agent   slots that follow the header
    20   4     u32       num_levels       agent   K of the policy (1..MAX_LEVELS)
    24   4     u32       agent_pid        agent   pid of the owning agent (0 = none)
    28   4     u32       config_seq       agent   seqlock over the config area (odd = being written)
    32   8     u64       generation       agent   +1 each time an agent (re)initializes the table
    40   8     u64       heartbeat_ns     agent   CLOCK_MONOTONIC ns, refreshed about every 100 ms
    48   4     u32       flags            agent   FLAG_* bits below
    52   12    -         reserved
    -- config area, rewritten only under config_seq --
    64   4     u32       num_class_map    agent   used entries of class_map (0..MAX_CLASS_MAP)
    68   4     u32       fallback_class   agent   class id when nothing else names one (0 = tp)
    72   256   32 x 8    class_map        agent   {i32 traffic_class, u32 class_id}
    328  16    u8[16]    default_level    agent   per class id: level until the agent writes one
    344  1     u8        gate_mode        agent   the policy's permit: GATE_MODE_* (0 = no [gating])
    345  1     -         reserved
    346  2     u16       gate_min_share   agent   guard share per mille (GATE_UNSET: the default)
    348  2     u16       gate_window_ms   agent   window of that share, ms (GATE_UNSET: the default)
    350  2     u16       gate_max_defer_ms agent  longest deferral, ms (GATE_UNSET: the default)
    352  128   16 x 8    level_marking    agent   per level {u8 dscp 0..63, 3 pad, u32 so_priority}
    480  3616  -         reserved (zero)

Slot ``i`` (``SLOT_SIZE`` = 128 bytes, at ``HEADER_SIZE + i * SLOT_SIZE``)::

    off  size  type  field          writer   meaning
    0    4     u32   state          both     SLOT_FREE / SLOT_CLAIMED / SLOT_ACTIVE / SLOT_CLOSED
    4    4     u32   pid            plugin   process that owns the connection
    8    8     u64   claim_seq      plugin   +1 on every claim; (index, claim_seq) names a flow
    16   8     u64   comm_id        plugin   NCCL commId (same on every rank of the comm)
    24   4     i32   peer_rank      plugin   sender rank from the NCCL tag (-1 unknown)
    28   4     i32   traffic_class  plugin   NCCL trafficClass (-1 undefined)
    32   4     u32   level          agent    level to use, or LEVEL_UNSET (use default_level)
    36   2     u16   class_id       plugin   FlowClass value
    38   1     u8    direction      plugin   DIR_SEND / DIR_RECV
    39   1     u8    flags          plugin   SLOT_FLAG_* (0 on a plain claim; the agent zeroes
                                             it when it frees the slot)
    40   8     u64   bytes          plugin   bytes handed to the sockets (atomic add)
    48   8     u64   messages       plugin   isend count (recv: completed irecv count)
    56   8     u64   open_ns        plugin   CLOCK_MONOTONIC ns at claim (moved: at the
                                             connection's opening)
    64   8     u64   last_ns        plugin   CLOCK_MONOTONIC ns of the latest message
    72   4     u32   net_op         plugin   last setNetAttr op bits (0 = none seen)
    76   4     u32   net_algo       plugin   last setNetAttr algo bits
    80   4     u32   net_proto      plugin   last setNetAttr proto bits
    84   4     u32   applied_level  plugin   level last applied to the sockets (LEVEL_UNSET none)
    88   8     u64   applied_ns     plugin   CLOCK_MONOTONIC ns when that level was applied
    96   8     u64   level_set_ns   agent    CLOCK_MONOTONIC ns when ``level`` was last written
    104  4     u32   dev            plugin   NCCL device index
    108  4     -     reserved
    112  8     u64   pid_ns         plugin   inode of the owner's pid namespace (0 = unknown):
                                             ``pid`` is its pid there (docs/deploy.md)
    120  8     u64   start_ticks    plugin   the owner's start, clock ticks after boot as the
                                             host counts them (0 = unknown; flowsched.shm.pidns)

Slot life cycle (the state machine):

* FREE -> CLAIMED: the plugin wins a compare-and-swap on ``state`` (so two connections never
  share a slot), then fills the fields, sets ``level`` to LEVEL_UNSET and bumps ``claim_seq``.
* CLAIMED -> ACTIVE: a release store by the plugin once every field is written. Readers ignore
  slots that are not ACTIVE or CLOSED.
* ACTIVE -> CLOSED: the plugin closes the connection. ``bytes`` is final.
* CLOSED -> FREE: the agent, after reporting the close. With no agent running, a plugin that
  finds no FREE slot may take a CLOSED one (CAS CLOSED -> CLAIMED). Slots whose ``pid`` no
  longer exists are reaped by the agent. The agent frees a slot by a CAS from the state it
  read to CLAIMED, a check of ``claim_seq``, then a store of FREE: a plugin that took the
  slot meanwhile (it saw a stale heartbeat) keeps it.
* A connection made before the table existed (it ran on a private slot), or whose table was
  re-created since, moves to the current table at a completed message once the plugin found
  it (it looks at most once a second): it claims a slot as above, with ``flags`` MOVED and
  ``bytes``, ``messages``, ``open_ns``, ``last_ns`` and ``applied_level`` carried over, and
  marks the old slot CLOSED.

The agent writes ``level`` with one aligned 4-byte store and then ``level_set_ns``; the plugin
reads ``level`` with one atomic load on every isend. A torn or stale read only delays a
priority change (priorities are advisory; no byte depends on them).

Every ``*_ns`` field is on the host's CLOCK_MONOTONIC (the initial time namespace's): a plugin
in a time namespace of its own (CLONE_NEWTIME) takes its monotonic offset off what it writes and
judges ``heartbeat_ns`` on it, as ``start_ticks`` is the host's count.
"""

from __future__ import annotations

import struct

MAGIC = 0x54465346  # bytes b"FSFT" read as a little-endian u32
VERSION = 1
HEADER_SIZE = 4096
SLOT_SIZE = 128
DEFAULT_NUM_SLOTS = 1024
MAX_LEVELS = 16
MAX_CLASS_MAP = 32
MAX_CLASSES = 16
LEVEL_UNSET = 0xFFFFFFFF
#: gate_mode values: the plugin's host-side permit as the policy file's [gating] sets it.
#: DEFAULT (0, also what an older agent's zeroed bytes say): no [gating], the gate_* numbers
#: are ignored; OFF / ON: enabled = false / true; TUNED: [gating] without ``enabled``. A
#: gate_* number of GATE_UNSET was not given. The plugin's FLOWSCHED_GATING* knobs win.
GATE_MODE_DEFAULT = 0
GATE_MODE_OFF = 1
GATE_MODE_ON = 2
GATE_MODE_TUNED = 3
GATE_UNSET = 0xFFFF

FLAG_AGENT_ATTACHED = 1 << 0
FLAG_COORDINATOR_CONNECTED = 1 << 1  # clear while the agent runs its local fallback policy

SLOT_FREE = 0
SLOT_CLAIMED = 1
SLOT_ACTIVE = 2
SLOT_CLOSED = 3

DIR_SEND = 0
DIR_RECV = 1

#: slot flags: MOVED, the connection was open before this slot (its counters carry over)
SLOT_FLAG_MOVED = 1 << 0

#: (name, offset, struct format) of every header field.
HEADER_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("magic", 0, "<I"),
    ("version", 4, "<I"),
    ("header_size", 8, "<I"),
    ("slot_size", 12, "<I"),
    ("num_slots", 16, "<I"),
    ("num_levels", 20, "<I"),
    ("agent_pid", 24, "<I"),
    ("config_seq", 28, "<I"),
    ("generation", 32, "<Q"),
    ("heartbeat_ns", 40, "<Q"),
    ("flags", 48, "<I"),
    ("num_class_map", 64, "<I"),
    ("fallback_class", 68, "<I"),
    ("class_map", 72, "<" + "iI" * MAX_CLASS_MAP),
    ("default_level", 328, f"<{MAX_CLASSES}B"),
    ("gate_mode", 344, "<B"),
    ("gate_min_share", 346, "<H"),
    ("gate_window_ms", 348, "<H"),
    ("gate_max_defer_ms", 350, "<H"),
    ("level_marking", 352, "<" + "B3xI" * MAX_LEVELS),
)

#: (name, offset, struct format) of every slot field, offsets relative to the slot.
SLOT_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("state", 0, "<I"),
    ("pid", 4, "<I"),
    ("claim_seq", 8, "<Q"),
    ("comm_id", 16, "<Q"),
    ("peer_rank", 24, "<i"),
    ("traffic_class", 28, "<i"),
    ("level", 32, "<I"),
    ("class_id", 36, "<H"),
    ("direction", 38, "<B"),
    ("flags", 39, "<B"),
    ("bytes", 40, "<Q"),
    ("messages", 48, "<Q"),
    ("open_ns", 56, "<Q"),
    ("last_ns", 64, "<Q"),
    ("net_op", 72, "<I"),
    ("net_algo", 76, "<I"),
    ("net_proto", 80, "<I"),
    ("applied_level", 84, "<I"),
    ("applied_ns", 88, "<Q"),
    ("level_set_ns", 96, "<Q"),
    ("dev", 104, "<I"),
    ("pid_ns", 112, "<Q"),
    ("start_ticks", 120, "<Q"),
)

CLASS_MAP_ENTRY = struct.Struct("<iI")
LEVEL_MARKING_ENTRY = struct.Struct("<B3xI")


def slot_offset(index: int) -> int:
    """Byte offset of slot ``index`` from the start of the table."""
    return HEADER_SIZE + index * SLOT_SIZE


def table_size(num_slots: int = DEFAULT_NUM_SLOTS) -> int:
    """Total size in bytes of a table with ``num_slots`` slots."""
    return HEADER_SIZE + num_slots * SLOT_SIZE


def _element_alignment(fmt: str) -> int:
    """Alignment of the first element of a struct format (its size, for these plain types)."""
    code = next(ch for ch in fmt if ch.isalpha() and ch != "x")
    return struct.calcsize("<" + code)


def _check_layout() -> None:
    """Fail at import time if a field overlaps another, is misaligned or leaves its block."""
    for fields, limit in ((HEADER_FIELDS, HEADER_SIZE), (SLOT_FIELDS, SLOT_SIZE)):
        end = 0
        for name, offset, fmt in fields:
            if offset < end or offset % _element_alignment(fmt):
                raise AssertionError(f"layout field {name} overlaps or is misaligned")
            end = offset + struct.calcsize(fmt)
        if end > limit:
            raise AssertionError("layout exceeds its block")


_check_layout()


def _whole(fields: tuple[tuple[str, int, str], ...], size: int) -> struct.Struct:
    """One struct over a whole block: ``fields`` in offset order, gaps as pad bytes."""
    parts, end = [], 0
    for _, offset, fmt in fields:
        parts.append(f"{offset - end}x" if offset > end else "")
        parts.append(fmt.lstrip("<"))
        end = offset + struct.calcsize(fmt)
    return struct.Struct("<" + "".join(parts) + (f"{size - end}x" if size > end else ""))


#: byte offset of every header field, and of every slot field relative to its slot
HEADER_OFFSET = {name: offset for name, offset, _ in HEADER_FIELDS}
SLOT_OFFSET = {name: offset for name, offset, _ in SLOT_FIELDS}
#: the whole 128-byte slot in one struct, fields in SLOT_FIELDS order (one unpack per snapshot)
SLOT_STRUCT = _whole(SLOT_FIELDS, SLOT_SIZE)
#: the config area the agent rewrites under the config_seq seqlock: num_class_map .. level_marking
CONFIG_START = HEADER_OFFSET["num_class_map"]
CONFIG_END = HEADER_OFFSET["level_marking"] + struct.calcsize(HEADER_FIELDS[-1][2])
