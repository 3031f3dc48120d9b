"""Python access to the node's shared-memory flow table (layout in :mod:`flowsched.shm.layout`).

The agent is the only Python writer in production:

* :meth:`FlowTable.create_or_attach` creates the table file (built complete in a temporary file
  of the same directory, mode 0600 or 0660 with a configured group, then linked into place, so
  the path never names a half-built table) or re-attaches to the one a previous agent left
  behind: magic, version and sizes are validated, the slots (and the connections they
  describe) are kept, and ``generation`` is bumped (mod 2^64). Agents starting at once are
  serialized by a ``flock`` on the directory: one creates, the others find its live owner.
* :meth:`FlowTable.write_config` rewrites the header's config area (trafficClass map, fallback
  class, per-class default levels, level -> DSCP / SO_PRIORITY marking) under the ``config_seq``
  seqlock; :meth:`FlowTable.read_config` reads it back consistently.
* :meth:`FlowTable.slots` yields consistent :class:`SlotSnapshot` copies of the ACTIVE and CLOSED
  slots; :meth:`FlowTable.set_level` writes a slot's ``level`` with one aligned 4-byte store
  (a ``memoryview`` cast to ``"I"``), then ``level_set_ns``.
* :meth:`FlowTable.release_slot` and :meth:`FlowTable.reap_dead` return slots to FREE.

Concurrency model. The C plugin updates slots with atomic instructions while the agent reads
them. The agent writes ``state`` only to free a slot: CLOSED -> FREE after reporting it, and
any state -> FREE for slots whose owning process is dead. A plugin that finds no FREE slot and
no live agent (its heartbeat looks stale: a stalled agent, or a job whose CLOCK_MONOTONIC is
offset by a time namespace) takes CLOSED slots with a compare-and-swap, so the agent first
takes the slot with a compare-and-swap of its own (``libatomic`` through ctypes: the same
instruction as the plugin's), from the state it judged to CLAIMED, and checks ``claim_seq``
before it clears and frees it: a plain check-then-store could free a slot a plugin had just
claimed, and the next claim would share it. Everything else the agent reads is copied out and
re-validated with ``(state, claim_seq)`` before and after the copy, the way a seqlock reader
would.

:class:`EmulatedPluginSlot` at the end of this module is TEST SUPPORT ONLY: it claims and drives
a slot the way the C plugin does, without atomics, so that tests and the end-to-end suite can
exercise the agent without an NCCL process.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import ctypes.util
import errno
import glob
import grp
import itertools
import logging
import mmap
import os
import stat
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from flowsched import rundir
from flowsched.flocks import lock_within
from flowsched.shm import layout as L
from flowsched.shm.pidns import UNKNOWN, PidNamespaces, start_ticks

log = logging.getLogger(__name__)

_HEADER = {name: (offset, struct.Struct(fmt)) for name, offset, fmt in L.HEADER_FIELDS}
_SLOT = {name: (offset, struct.Struct(fmt)) for name, offset, fmt in L.SLOT_FIELDS}
_SLOT_STRUCT = L.SLOT_STRUCT
_CONFIG_START, _CONFIG_END = L.CONFIG_START, L.CONFIG_END
# Word indexes for the aligned single-word loads and stores (memoryview casts of the map):
# header words are indexes into the whole table, slot words are added to slot_offset // size.
_H32 = {name: L.HEADER_OFFSET[name] // 4 for name in ("agent_pid", "config_seq", "flags")}
_HEARTBEAT64 = L.HEADER_OFFSET["heartbeat_ns"] // 8
_S32 = {name: L.SLOT_OFFSET[name] // 4 for name in ("state", "pid", "level")}
_S64 = {
    name: L.SLOT_OFFSET[name] // 8
    for name in ("claim_seq", "bytes", "level_set_ns", "open_ns", "pid_ns", "start_ticks")
}
#: offsets inside the config area (what _pack_config / _unpack_config handle)
_AREA_FIELDS = ("class_map", "default_level", "level_marking", "gate_mode", "gate_min_share")
_AREA = {
    name: L.HEADER_OFFSET[name] - _CONFIG_START
    for name in (*_AREA_FIELDS, "gate_window_ms", "gate_max_defer_ms")
}
_CONFIG_RETRIES = 10_000
#: a table whose agent pid is alive and whose heartbeat is younger than this has a live owner
LIVE_AGENT_SECONDS = 2.0
#: how long create_or_attach waits for another agent creating or attaching the same table (s)
CREATION_LOCK_SECONDS = 10.0
#: a pid the kernel can give a process (Linux pid_max is at most 2^22; the slot word is a u32)
MAX_PID = 2**31 - 1
#: a slot's owner is taken to have started after the claim (its pid was reused) only when
#: /proc says it started more than this many clock ticks after the slot's ``open_ns``
PID_REUSE_TOLERANCE_TICKS = 3
_U32, _U64 = 2**32, 2**64
#: suffix of the temporary file a new table is built in (``.<name>.<random>.building``)
_BUILDING = ".building"
#: the header's scalar fields (magic .. flags): all zero in a file whose creator died
_HEADER_SCALARS = 64


def _load_cas_u32() -> Callable[[int, int, int], bool] | None:
    """A compare-and-swap of the u32 at an address (``cas(address, expected, desired)``,
    True when it swapped), from libatomic; None when the library is missing."""
    fn = None
    for name in ("libatomic.so.1", None):
        # find_library runs ldconfig: only when the usual name is not there
        with contextlib.suppress(OSError, AttributeError, TypeError):
            lib = ctypes.CDLL(name or ctypes.util.find_library("atomic"))
            fn = getattr(lib, "__atomic_compare_exchange_4")
            break
    if fn is None:
        return None
    u32 = ctypes.c_uint32
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(u32), u32, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_bool
    seq_cst = 5  # __ATOMIC_SEQ_CST

    def cas(address: int, expected: int, desired: int) -> bool:
        return bool(fn(address, ctypes.byref(u32(expected)), desired, seq_cst, seq_cst))

    return cas


#: the agent's compare-and-swap on slot ``state`` words (None: libatomic is missing)
_CAS_U32 = _load_cas_u32()


class TableError(Exception):
    """The table file is missing, unsafe, or not a flowsched table of this version."""


@dataclass(frozen=True, slots=True)
class LevelMarking:
    """How one level is put on the wire: DSCP (0..63) and SO_PRIORITY."""

    dscp: int
    so_priority: int

    @property
    def tos(self) -> int:
        """The IP TOS / IPv6 traffic class byte (DSCP in the upper six bits, ECN bits zero)."""
        return (self.dscp & 0x3F) << 2


@dataclass(frozen=True, slots=True)
class TableConfig:
    """The header's config area.

    ``class_map`` pairs an NCCL trafficClass with a FlowClass id; ``default_levels[c]`` is the
    level a connection of class id ``c`` uses until the agent writes one; ``markings[l]`` is the
    marking of level ``l`` (``len(markings)`` = ``num_levels``). ``gate_*``: the plugin's
    host-side permit as the policy file sets it (layout.GATE_MODE_*; layout.GATE_UNSET = the
    plugin's default).
    """

    num_levels: int
    markings: tuple[LevelMarking, ...]
    class_map: tuple[tuple[int, int], ...] = ()
    fallback_class: int = 0
    default_levels: tuple[int, ...] = ()
    gate_mode: int = L.GATE_MODE_DEFAULT
    gate_min_share: int = L.GATE_UNSET
    gate_window_ms: int = L.GATE_UNSET
    gate_max_defer_ms: int = L.GATE_UNSET

    def __post_init__(self) -> None:
        problems = _config_problems(self)
        if problems:
            raise ValueError("invalid table config: " + "; ".join(problems))

    def default_level(self, class_id: int) -> int:
        """Default level of class id ``class_id`` (the last level when none is configured)."""
        if 0 <= class_id < len(self.default_levels):
            return self.default_levels[class_id]
        return self.num_levels - 1

    def marking(self, level: int) -> LevelMarking:
        """Marking of ``level`` (clamped into ``0..num_levels-1``)."""
        return self.markings[min(max(level, 0), self.num_levels - 1)]

    def class_for_traffic_class(self, traffic_class: int) -> int:
        """Class id the map gives ``traffic_class``, else the fallback class."""
        for tc, class_id in self.class_map:
            if tc == traffic_class:
                return class_id
        return self.fallback_class


def _config_problems(cfg: TableConfig) -> list[str]:
    problems: list[str] = []
    if not 1 <= cfg.num_levels <= L.MAX_LEVELS:
        problems.append(f"num_levels {cfg.num_levels} not in 1..{L.MAX_LEVELS}")
    if len(cfg.markings) != cfg.num_levels:
        problems.append(f"markings has {len(cfg.markings)} entries, num_levels is {cfg.num_levels}")
    for i, m in enumerate(cfg.markings):
        if not 0 <= m.dscp <= 63 or not 0 <= m.so_priority <= 0xFFFFFFFF:
            problems.append(f"markings[{i}] out of range: {m}")
    if len(cfg.class_map) > L.MAX_CLASS_MAP:
        problems.append(f"class_map has {len(cfg.class_map)} entries (max {L.MAX_CLASS_MAP})")
    for i, (tc, cid) in enumerate(cfg.class_map):
        if not -(2**31) <= tc < 2**31 or not 0 <= cid < L.MAX_CLASSES:
            problems.append(f"class_map[{i}] out of range: {(tc, cid)}")
    if not 0 <= cfg.fallback_class < L.MAX_CLASSES:
        problems.append(f"fallback_class {cfg.fallback_class} not in 0..{L.MAX_CLASSES - 1}")
    if len(cfg.default_levels) > L.MAX_CLASSES:
        problems.append(f"default_levels has more than {L.MAX_CLASSES} entries")
    for i, lvl in enumerate(cfg.default_levels):
        if not 0 <= lvl < max(cfg.num_levels, 1):
            problems.append(f"default_levels[{i}] = {lvl} not in 0..{cfg.num_levels - 1}")
    if not L.GATE_MODE_DEFAULT <= cfg.gate_mode <= L.GATE_MODE_TUNED:
        problems.append(f"gate_mode {cfg.gate_mode} is not a GATE_MODE_* value")
    if not (0 <= cfg.gate_min_share <= 1000 or cfg.gate_min_share == L.GATE_UNSET):
        problems.append(f"gate_min_share {cfg.gate_min_share} not in 0..1000 per mille")
    for name in ("gate_window_ms", "gate_max_defer_ms"):
        if not 0 <= getattr(cfg, name) <= L.GATE_UNSET:
            problems.append(f"{name} {getattr(cfg, name)} not in 0..{L.GATE_UNSET}")
    return problems


@dataclass(frozen=True, slots=True)
class SlotSnapshot:
    """A consistent copy of one slot (every field of the layout, by name)."""

    index: int
    state: int
    pid: int
    claim_seq: int
    comm_id: int
    peer_rank: int
    traffic_class: int
    level: int
    class_id: int
    direction: int
    flags: int
    bytes: int
    messages: int
    open_ns: int
    last_ns: int
    net_op: int
    net_algo: int
    net_proto: int
    applied_level: int
    applied_ns: int
    level_set_ns: int
    dev: int
    pid_ns: int
    start_ticks: int

    @property
    def key(self) -> tuple[int, int]:
        """``(index, claim_seq)``: names one connection for the lifetime of the table."""
        return (self.index, self.claim_seq)


@dataclass(slots=True)
class AttachInfo:
    """What :meth:`FlowTable.create_or_attach` did."""

    created: bool
    generation: int
    previous_agent_pid: int
    kept_slots: list[int] = field(default_factory=list)
    #: header fields found with values the agent had to repair, as ``"field: what"``
    repaired: list[str] = field(default_factory=list)
    #: the table's own size (a re-attached table keeps it, whatever ``num_slots`` asked for)
    num_slots: int = 0


@dataclass(slots=True)
class ReapReport:
    """What the last :meth:`FlowTable.reap_dead` pass found besides the slots it freed."""

    #: busy slots whose ``pid`` word no process can have (0 or >= 2^31): reaped as dead
    bad_pid: list[int] = field(default_factory=list)
    #: slots whose pid was alive but belongs to a process started after the slot's claim
    reused_pid: list[int] = field(default_factory=list)
    #: slots the pass could not handle, with the error (the pass went on with the others)
    errors: list[tuple[int, Exception]] = field(default_factory=list)
    #: slots of an owner in another pid namespace that /proc could not place (kept)
    unplaced: list[int] = field(default_factory=list)


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in ns: the clock every ``*_ns`` field of the table uses."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a process of another user counts as alive).

    0, negative numbers and numbers above :data:`MAX_PID` name no process: False.
    """
    if not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def process_start_ns(pid: int, read: Callable[[str], bytes] = _read_bytes) -> int | None:
    """When process ``pid`` started, on the CLOCK_MONOTONIC clock of the table's ``*_ns``
    fields, or None when unknown (no such process, /proc unreadable or unparsable).

    ``/proc/<pid>/stat`` field 22 is the start in clock ticks since boot (CLOCK_BOOTTIME,
    which counts time suspended; CLOCK_MONOTONIC does not). The difference of the two clocks
    now is subtracted, so a suspend after the process started makes it look older, never
    younger: the estimate errs towards "the slot's owner". ``read`` is injected by tests.
    """
    try:
        ticks = start_ticks(read(f"/proc/{pid}/stat"))
    except OSError:
        return None
    if not ticks:
        return None
    offset = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - monotonic_ns()
    return ticks * 1_000_000_000 // _clock_ticks() - max(offset, 0)


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") or 100


class FlowTable:
    """A mapped flow table. Use :meth:`create_or_attach` (agent) or :meth:`open` (readers, tests).

    Not thread-safe: one thread of the agent owns the object.
    """

    def __init__(self, path: str, mm: mmap.mmap, *, writable: bool) -> None:
        self.path = path
        self._mm = mm
        self._writable = writable
        self._u32 = memoryview(mm).cast("I")
        self._u64 = memoryview(mm).cast("Q")
        #: the map as a ctypes array, for the address the compare-and-swap takes (writable)
        self._words = (ctypes.c_char * len(mm)).from_buffer(mm) if writable else None
        self.num_slots = self._get("num_slots")
        #: the ``config_seq`` this mapping's last :meth:`write_config` left (None: none yet)
        self.written_config_seq: int | None = None
        #: CLAIMED slots with a dead pid at the last reap_dead: index -> (pid, claim_seq)
        self._claimed_seen: dict[int, tuple[int, int]] = {}
        #: what the last reap_dead pass found besides the slots it freed
        self.last_reap = ReapReport()
        #: maps the owners of slots written in other pid namespaces to pids here
        self.pid_namespaces = PidNamespaces()

    # ----------------------------------------------------------------- opening and closing
    @classmethod
    def create_or_attach(
        cls,
        path: str,
        *,
        num_slots: int = L.DEFAULT_NUM_SLOTS,
        group: str | int | None = None,
        agent_pid: int | None = None,
    ) -> tuple[FlowTable, AttachInfo]:
        """Create the table at ``path``, or re-attach to a valid one left by a previous agent.

        The directory must be the agent's own (:func:`flowsched.rundir.prepare_private_dir`;
        created when missing). A new table is built complete in a temporary file there and
        linked into place, so the path never names a half-built table. The file is opened with
        ``O_NOFOLLOW`` and must be a regular file owned by the effective user; its mode is set
        to 0600, or 0660 with ``group`` as its group. A file of size zero or with an all-zero
        header (an older agent died while creating it) is replaced by a fresh table. Agents
        starting at once take turns (a ``flock`` on the directory), so only one creates and the
        others find its live owner. A re-attached table keeps its own size whatever
        ``num_slots`` asks for (``AttachInfo.num_slots``).
        Raises :class:`TableError` on an unsafe directory, a file of another user, a symlink, a
        bad magic/version/size, a header value this agent cannot use (named), or a table owned
        by a running agent.
        """
        if not 1 <= num_slots <= (1 << 24):
            raise ValueError(f"num_slots {num_slots} not in 1..{1 << 24}")
        gid = _resolve_group(group)
        directory = os.path.dirname(os.path.abspath(path))
        try:
            rundir.prepare_private_dir(directory, gid)
        except rundir.RuntimeDirError as exc:
            raise TableError(f"flow table {path}: {exc}") from None
        owner = agent_pid or os.getpid()
        if _CAS_U32 is None:
            log.warning(
                "libatomic.so.1 not found: the agent frees slots without a compare-and-swap "
                "and may free one a plugin is claiming just then (install libatomic1)"
            )
        with _creation_lock(directory, path):
            table = cls._open_existing(path, gid)
            if table is None:
                return cls._create(path, num_slots, gid, owner)
            try:
                table._validate_header()
                info = table._reattach(owner)
            except BaseException:
                table.close()
                raise
        return table, info

    @classmethod
    def _open_existing(cls, path: str, gid: int | None) -> FlowTable | None:
        """The table at ``path`` mapped, or None when there is none or it is an unfinished one
        (size 0, or an all-zero header: its creator died; the caller builds a new one)."""
        fd = _open_private(path)
        if fd is None:
            return None
        try:
            _secure_fd(fd, path, gid)
            size = os.fstat(fd).st_size
            if size == 0 or os.pread(fd, _HEADER_SCALARS, 0) == bytes(_HEADER_SCALARS):
                return None
            _validate_size(path, size)
            return cls(path, _map(fd, size, True), writable=True)
        finally:
            os.close(fd)

    @classmethod
    def _create(
        cls, path: str, num_slots: int, gid: int | None, agent_pid: int
    ) -> tuple[FlowTable, AttachInfo]:
        """Build a table in a temporary file next to ``path``, then put it in place (the caller
        holds the creation lock)."""
        directory, base = os.path.split(os.path.abspath(path))
        _remove_unfinished(directory, base)
        fd, building = tempfile.mkstemp(prefix=f".{base}.", suffix=_BUILDING, dir=directory)
        table: FlowTable | None = None
        try:
            try:
                _secure_fd(fd, building, gid)
                os.ftruncate(fd, L.table_size(num_slots))
                table = cls(path, _map(fd, L.table_size(num_slots), True), writable=True)
            finally:
                os.close(fd)
            info = table._initialize(num_slots, agent_pid)
            os.replace(building, path)  # atomic; the lock keeps other agents out meanwhile
        except BaseException:
            if table is not None:
                table.close()
            with contextlib.suppress(OSError):
                os.unlink(building)
            raise
        return table, info

    @classmethod
    def open(cls, path: str, *, writable: bool = False) -> FlowTable:
        """Map an existing table (as the plugin does); validates magic, version and sizes.

        Like the plugin, it refuses a symbolic link (``O_NOFOLLOW``), and a file owned by
        anyone but root or this user, or writable by others: a table another user created
        first would let them feed this process levels and read its flows.
        """
        # O_NONBLOCK: a FIFO another user put at the path would block a read-only open for
        # good (a regular file ignores the flag); fstat below refuses it
        flags = os.O_RDWR if writable else os.O_RDONLY
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise TableError(f"cannot open flow table {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise TableError(f"flow table {path} is not a regular file")
            _check_trusted_owner(path, st)
            _validate_size(path, st.st_size)
            table = cls(path, _map(fd, st.st_size, writable), writable=writable)
        finally:
            os.close(fd)
        try:
            table._validate_header()
        except TableError:
            table.close()
            raise
        return table

    def close(self) -> None:
        """Unmap the table (idempotent)."""
        if self._mm.closed:
            return
        self._u32.release()
        self._u64.release()
        self._words = None  # its export of the map must go before the map closes
        self._mm.close()

    def __enter__(self) -> FlowTable:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------- header
    def header(self) -> dict[str, int]:
        """The scalar header fields by name (a plain snapshot, no seqlock)."""
        return {name: self._get(name) for name, _, fmt in L.HEADER_FIELDS if len(fmt) == 2}

    @property
    def generation(self) -> int:
        """How many times an agent has (re)initialized this table."""
        return self._get("generation")

    def heartbeat(self, now_ns: int | None = None) -> None:
        """Refresh ``heartbeat_ns`` (the agent calls this about every 100 ms)."""
        self._u64[_HEARTBEAT64] = monotonic_ns() if now_ns is None else now_ns

    def set_flag(self, flag: int, on: bool) -> None:
        """Set or clear one ``FLAG_*`` bit (aligned 4-byte store)."""
        flags = self._u32[_H32["flags"]]
        self._u32[_H32["flags"]] = (flags | flag) if on else (flags & ~flag)

    def flags(self) -> int:
        """The current ``flags`` word."""
        return self._u32[_H32["flags"]]

    def detach(self) -> None:
        """Mark the table as having no agent (clean agent shutdown; slots are kept)."""
        self._u32[_H32["agent_pid"]] = 0
        self.set_flag(L.FLAG_AGENT_ATTACHED | L.FLAG_COORDINATOR_CONNECTED, False)

    # ----------------------------------------------------------------- config (seqlock)
    def write_config(self, cfg: TableConfig) -> None:
        """Rewrite the config area and ``num_levels`` under the ``config_seq`` seqlock.

        The area is packed before ``config_seq`` turns odd, so that the seqlock is held only
        for the copy itself: a reader that finds it odd must retry or use an older copy.
        """
        area = _pack_config(cfg)
        seq_index = _H32["config_seq"]
        odd = ((self._u32[seq_index] + 1) | 1) % _U32  # mod 2^32: a u32 word wraps
        self._u32[seq_index] = odd  # odd: being written
        self._mm[_CONFIG_START:_CONFIG_END] = area
        self._put("num_levels", cfg.num_levels)
        self.written_config_seq = (odd + 1) % _U32
        self._u32[seq_index] = self.written_config_seq  # even again: stable

    def config_matches(self, cfg: TableConfig) -> bool:
        """Whether the config area holds exactly what :meth:`write_config` would write for
        ``cfg`` (compared as packed bytes: the agent checks for tampering this way), under the
        ``config_seq`` this mapping's last write left there. The word counts too: a plugin
        keeps the copy it read for as long as ``config_seq`` stays what it was then, so bad
        markings written under a proper seqlock and the bytes put back without moving the word
        would stay in force there; an odd word (a write never finished) has every reader
        retrying or on an older copy."""
        seq = self._u32[_H32["config_seq"]]
        if seq & 1 or (self.written_config_seq is not None and seq != self.written_config_seq):
            return False
        area = bytes(self._mm[_CONFIG_START:_CONFIG_END])
        return area == _pack_config(cfg) and self._get("num_levels") == cfg.num_levels

    def read_config(self) -> TableConfig:
        """Read the config area consistently (retries while a writer holds the seqlock)."""
        for _ in range(_CONFIG_RETRIES):
            before = self._u32[_H32["config_seq"]]
            if before & 1:
                continue
            raw = bytes(self._mm[_CONFIG_START:_CONFIG_END])
            num_levels = self._get("num_levels")
            if self._u32[_H32["config_seq"]] == before:
                return _unpack_config(raw, num_levels)
        raise TableError(f"flow table {self.path}: config seqlock never stabilized")

    # ----------------------------------------------------------------- slots
    def slot(self, index: int) -> SlotSnapshot | None:
        """A consistent copy of slot ``index``, or None when it is FREE or being claimed."""
        self._check_index(index)
        off = L.slot_offset(index)
        w32, w64 = off // 4, off // 8
        for _ in range(100):
            state, seq = self._u32[w32 + _S32["state"]], self._u64[w64 + _S64["claim_seq"]]
            if state not in (L.SLOT_ACTIVE, L.SLOT_CLOSED):
                return None
            values = _SLOT_STRUCT.unpack_from(self._mm, off)
            if (
                self._u32[w32 + _S32["state"]] == state
                and self._u64[w64 + _S64["claim_seq"]] == seq
            ):
                return SlotSnapshot(index, *values)
        return None  # the slot kept changing under us: skip it this round

    def slots(self) -> Iterator[SlotSnapshot]:
        """Consistent copies of every ACTIVE or CLOSED slot, in index order."""
        for index, _, _, _ in self.busy_slots():
            snap = self.slot(index)
            if snap is not None:
                yield snap

    def busy_slots(self) -> list[tuple[int, int, int, int]]:
        """``(index, state, claim_seq, bytes)`` of every ACTIVE or CLOSED slot, cheaply.

        Reads the three words of all slots with three strided copies (no per-slot Python work
        for FREE slots). The words of one slot may come from different moments; callers must
        re-read with :meth:`slot` before acting on anything but a byte count.
        """
        step32, step64 = L.SLOT_SIZE // 4, L.SLOT_SIZE // 8
        first32, first64 = L.HEADER_SIZE // 4, L.HEADER_SIZE // 8
        states = self._u32[first32 + _S32["state"] :: step32].tolist()
        if not any(states):
            return []
        seqs = self._u64[first64 + _S64["claim_seq"] :: step64].tolist()
        counts = self._u64[first64 + _S64["bytes"] :: step64].tolist()
        busy = itertools.compress(range(len(states)), states)  # C speed over FREE (0) slots
        return [
            (i, states[i], seqs[i], counts[i])
            for i in busy
            if states[i] == L.SLOT_ACTIVE or states[i] == L.SLOT_CLOSED
        ]

    def slot_column(self, name: str) -> list[int]:
        """Field ``name`` (a u32 or u64 slot field) of every slot in index order, in one strided
        copy. As with :meth:`busy_slots`, values of different slots and fields may come from
        different moments (the agent's metrics read ``applied_*`` this way on every scan)."""
        fmt = next((f for n, _, f in L.SLOT_FIELDS if n == name), None)
        if fmt not in ("<I", "<Q"):
            raise ValueError(f"slot field {name!r} is not a u32 or u64 field")
        width = 4 if fmt == "<I" else 8
        words = self._u32 if width == 4 else self._u64
        first = (L.HEADER_SIZE + L.SLOT_OFFSET[name]) // width
        return words[first :: L.SLOT_SIZE // width].tolist()  # type: ignore[no-any-return]

    def slot_state(self, index: int) -> int:
        """The raw ``state`` word of slot ``index``."""
        self._check_index(index)
        return int(self._u32[L.slot_offset(index) // 4 + _S32["state"]])

    def set_level(self, index: int, level: int, now_ns: int | None = None) -> None:
        """Write slot ``index``'s level: one aligned 4-byte store, then ``level_set_ns``."""
        self._check_index(index)
        if not (0 <= level < L.MAX_LEVELS or level == L.LEVEL_UNSET):
            raise ValueError(f"level {level} not in 0..{L.MAX_LEVELS - 1}")
        off = L.slot_offset(index)
        self._u32[off // 4 + _S32["level"]] = level
        self._u64[off // 8 + _S64["level_set_ns"]] = monotonic_ns() if now_ns is None else now_ns

    def release_slot(self, index: int, claim_seq: int) -> bool:
        """CLOSED -> FREE for the connection ``(index, claim_seq)``; False if it is not that one."""
        self._check_index(index)
        off = L.slot_offset(index)
        state, seq = off // 4 + _S32["state"], off // 8 + _S64["claim_seq"]
        if self._u32[state] != L.SLOT_CLOSED or self._u64[seq] != claim_seq:
            return False
        return self._free_if(off, L.SLOT_CLOSED, claim_seq)

    def reap_dead(
        self,
        *,
        alive: Callable[[int], bool] = pid_alive,
        started_ns: Callable[[int], int | None] = process_start_ns,
    ) -> list[SlotSnapshot]:
        """Free the CLAIMED/ACTIVE/CLOSED slots whose owner no longer exists; return what
        they held (the caller reports the connections as closed).

        A slot's owner is gone when its ``pid`` is not alive, is no pid at all (0 or above
        :data:`MAX_PID`: counted in :attr:`last_reap`), or is alive but started more than
        :data:`PID_REUSE_TOLERANCE_TICKS` after the slot's ``open_ns`` (the pid was reused;
        ``started_ns``, :func:`process_start_ns`, unknown = alive). Liveness is judged by
        pid: the pid the slot names in its ``pid_ns`` is first mapped to a pid here
        (:attr:`pid_namespaces`; an owner /proc cannot place is kept, in
        :attr:`ReapReport.unplaced`). The states are read
        with one strided copy: Python work is done for busy slots only, each pid judged once.
        An error on one slot is recorded in :attr:`last_reap`; the pass goes on with the others.
        """
        report = self.last_reap = ReapReport()
        step32, first32 = L.SLOT_SIZE // 4, L.HEADER_SIZE // 4
        states = self._u32[first32 + _S32["state"] :: step32].tolist()
        if not any(states):
            self._claimed_seen = {}
            return []
        verdicts: dict[int, tuple[bool, int | None]] = {}

        def owner(pid: int) -> tuple[bool, int | None]:
            if pid not in verdicts:
                live = alive(pid)
                verdicts[pid] = (live, started_ns(pid) if live else None)
            return verdicts[pid]

        placed: dict[tuple[int, int, int], int | None] = {}  # a process's slots: placed once

        def place(ns: int, pid: int, since_ns: int, start: int) -> int | None:
            if (ns, pid, start) not in placed:
                placed[ns, pid, start] = self.pid_namespaces.local_pid(ns, pid, since_ns, start)
            return placed[ns, pid, start]

        reaped: list[SlotSnapshot] = []
        claimed: dict[int, tuple[int, int]] = {}
        for index in itertools.compress(range(len(states)), states):
            try:
                snap = self._reap_slot(index, owner, place, claimed, report)
            except Exception as exc:  # one odd slot never stops the reaper
                report.errors.append((index, exc))
                continue
            if snap is not None:
                reaped.append(snap)
        self._claimed_seen = claimed
        return reaped

    def _reap_slot(
        self,
        index: int,
        owner: Callable[[int], tuple[bool, int | None]],
        place: Callable[[int, int, int, int], int | None],
        claimed: dict[int, tuple[int, int]],
        report: ReapReport,
    ) -> SlotSnapshot | None:
        off = L.slot_offset(index)
        state_word, seq_word = off // 4 + _S32["state"], off // 8 + _S64["claim_seq"]
        state, seq = self._u32[state_word], self._u64[seq_word]
        if state == L.SLOT_FREE:
            return None
        pid = self._u32[off // 4 + _S32["pid"]]
        opened = self._u64[off // 8 + _S64["open_ns"]]
        settled = state in (L.SLOT_ACTIVE, L.SLOT_CLOSED)  # pid and open_ns are the owner's
        if not 0 < pid <= MAX_PID:
            if settled:
                report.bad_pid.append(index)
        elif (here := place(self._owner_ns(off), pid, opened, self._owner_start(off))) == UNKNOWN:
            report.unplaced.append(index)
            return None
        elif here is not None:
            live, started = owner(here)
            if live and not (settled and self._reused(off, started)):
                return None
            if live:
                report.reused_pid.append(index)
        if state == L.SLOT_CLAIMED:
            # The plugin writes its pid just after claiming, so a fresh claim still shows
            # the previous (dead) owner's pid: reap a CLAIMED slot only when it sat
            # unchanged since the previous pass (its claimer died before filling it).
            mark = (pid, seq)
            if self._claimed_seen.get(index) != mark:
                claimed[index] = mark
                return None
        snap = SlotSnapshot(index, *_SLOT_STRUCT.unpack_from(self._mm, off))
        if not self._free_if(off, state, seq):
            return None  # changed under us: judge it again at the next pass
        return snap

    def _owner_ns(self, off: int) -> int:
        return int(self._u64[off // 8 + _S64["pid_ns"]])

    def _owner_start(self, off: int) -> int:
        return int(self._u64[off // 8 + _S64["start_ticks"]])

    def _cas_state(self, off: int, expected: int, desired: int) -> bool:
        """Compare-and-swap the ``state`` word of the slot at ``off``."""
        word = off // 4 + _S32["state"]
        if _CAS_U32 is not None and self._words is not None:
            return _CAS_U32(ctypes.addressof(self._words) + word * 4, expected, desired)
        if self._u32[word] != expected:  # no libatomic: racy (create_or_attach warned)
            return False
        self._u32[word] = desired
        return True

    def _free_if(self, off: int, state: int, claim_seq: int) -> bool:
        """FREE the slot at ``off`` if it still is in ``state`` with ``claim_seq``.

        The slot is first taken from ``state`` to CLAIMED with a compare-and-swap, so a plugin
        that claimed it meanwhile keeps it (its CAS from CLOSED won first, or ours makes it
        look elsewhere), and ``claim_seq`` is checked while the agent holds it (a plugin may
        have claimed, used and closed it again since it was read). The fields are cleared and
        FREE stored only then: plugins never write a CLAIMED slot they did not claim."""
        if not self._cas_state(off, state, L.SLOT_CLAIMED):
            return False
        if self._u64[off // 8 + _S64["claim_seq"]] != claim_seq:
            self._cas_state(off, L.SLOT_CLAIMED, state)  # put back (unless its owner closed it)
            return False
        self._free(off)
        return True

    def _free(self, off: int) -> None:
        """FREE the slot at ``off``, its ``pid_ns``, ``start_ticks`` and ``flags`` zeroed first:
        a plugin older than those fields claims it without writing them, and must not inherit
        its predecessor's."""
        self._mm[off + L.SLOT_OFFSET["flags"]] = 0
        self._u64[off // 8 + _S64["pid_ns"]] = 0
        self._u64[off // 8 + _S64["start_ticks"]] = 0
        self._u32[off // 4 + _S32["state"]] = L.SLOT_FREE

    def owner_key(self, snap: SlotSnapshot) -> int:
        """``snap``'s owner as :meth:`PidNamespaces.process_key
        <flowsched.shm.pidns.PidNamespaces.process_key>` names it: its pid when it shares
        the agent's pid namespace."""
        return self.pid_namespaces.process_key(snap.pid_ns, snap.pid)

    def _reused(self, off: int, started: int | None) -> bool:
        """Whether a process that started at ``started`` (CLOCK_MONOTONIC ns) came after the
        claim of the slot at ``off``: then it cannot be the slot's owner."""
        open_ns = self._u64[off // 8 + L.SLOT_OFFSET["open_ns"] // 8]
        if started is None or open_ns == 0:
            return False
        tolerance = PID_REUSE_TOLERANCE_TICKS * 1_000_000_000 // _clock_ticks()
        return bool(started > open_ns + tolerance)

    # ----------------------------------------------------------------- internals
    def _get(self, name: str) -> int:
        offset, st = _HEADER[name]
        value: int = st.unpack_from(self._mm, offset)[0]
        return value

    def _put(self, name: str, value: int) -> None:
        offset, st = _HEADER[name]
        st.pack_into(self._mm, offset, value)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} not in 0..{self.num_slots - 1}")

    def _initialize(self, num_slots: int, agent_pid: int) -> AttachInfo:
        """Fill a fresh (all-zero) file's header and slots; the magic goes last."""
        for name, value in (
            ("version", L.VERSION),
            ("header_size", L.HEADER_SIZE),
            ("slot_size", L.SLOT_SIZE),
            ("num_slots", num_slots),
            ("num_levels", 1),
            ("agent_pid", agent_pid),
            ("generation", 1),
            ("flags", L.FLAG_AGENT_ATTACHED),
        ):
            self._put(name, value)
        self.num_slots = num_slots
        first = L.HEADER_SIZE // 4 + _S32["level"]
        unset = array.array("I", [L.LEVEL_UNSET]) * num_slots
        self._u32[first :: L.SLOT_SIZE // 4] = memoryview(unset)  # one strided copy
        self.heartbeat()
        self._put("magic", L.MAGIC)  # last: a reader that sees the magic sees the rest
        return AttachInfo(created=True, generation=1, previous_agent_pid=0, num_slots=num_slots)

    def _reattach(self, agent_pid: int) -> AttachInfo:
        """Take over a validated table: refuse a live owner, repair what can be repaired, bump
        ``generation``. A header value that still breaks this becomes a :class:`TableError`
        naming the field."""
        with self._header_field("agent_pid"):
            previous = self._get("agent_pid")
            beat_age = (monotonic_ns() - self._get("heartbeat_ns")) / 1e9
            live = pid_alive(previous) and abs(beat_age) < LIVE_AGENT_SECONDS
        if previous not in (0, agent_pid) and live:
            raise TableError(
                f"flow table {self.path} is owned by a running agent (pid {previous}, heartbeat "
                f"{beat_age:.1f} s ago); stop it or choose another --table path"
            )
        repaired = []
        with self._header_field("config_seq"):
            seq = self._u32[_H32["config_seq"]]
            if seq & 1:
                # A writer died inside the seqlock: the area may be half rewritten. Making the
                # word even here would hand plugins that torn area as a consistent copy; it
                # stays odd (plugins keep the copy they have) until write_config rewrites the
                # whole area and makes it even.
                repaired.append(f"config_seq: odd ({seq:#x}), left for the config rewrite")
        with self._header_field("generation"):
            generation = self.generation % (_U64 - 1) + 1  # never 0: 2^64-1 wraps to 1
            self._put("generation", generation)
        with self._header_field("agent_pid"):
            self._put("agent_pid", agent_pid)
        with self._header_field("flags"):
            self.set_flag(L.FLAG_AGENT_ATTACHED, True)
        with self._header_field("heartbeat_ns"):
            self.heartbeat()
        kept = [s.index for s in self.slots()]
        return AttachInfo(False, generation, previous, kept, repaired, self.num_slots)

    @contextlib.contextmanager
    def _header_field(self, name: str) -> Iterator[None]:
        try:
            yield
        except (ValueError, OverflowError, struct.error) as exc:
            raise TableError(
                f"flow table {self.path}: header field {name} holds {self._get(name)}, which "
                f"this agent cannot use ({exc}); remove the file to start afresh (running jobs "
                "keep the old table until they restart)"
            ) from None

    def _validate_header(self) -> None:
        magic = self._get("magic")
        if magic != L.MAGIC:
            raise TableError(
                f"{self.path} is not a flowsched flow table (magic {magic:#010x}, "
                f"expected {L.MAGIC:#010x}); remove it or choose another --table path (jobs "
                "still using a removed table keep it until they restart)"
            )
        for name, expected in (
            ("version", L.VERSION),
            ("header_size", L.HEADER_SIZE),
            ("slot_size", L.SLOT_SIZE),
        ):
            value = self._get(name)
            if value != expected:
                raise TableError(f"flow table {self.path}: {name} is {value}, expected {expected}")
        num_slots = self._get("num_slots")
        if L.table_size(num_slots) != len(self._mm) or num_slots == 0:
            raise TableError(
                f"flow table {self.path}: num_slots {num_slots} does not match the file size "
                f"{len(self._mm)} (truncated or corrupt)"
            )
        self.num_slots = num_slots


def _resolve_group(group: str | int | None) -> int | None:
    if group is None or isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise TableError(f"unknown group {group!r} for the flow table") from None


@contextlib.contextmanager
def _creation_lock(directory: str, path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the table's directory (agents creating or attaching the
    same table take turns; held for the create/attach only)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not lock_within(fd, CREATION_LOCK_SECONDS):
            raise TableError(
                f"flow table {path}: another agent has been creating or attaching it for "
                f"{CREATION_LOCK_SECONDS:.0f} s; stop it or choose another --table path"
            )
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_unfinished(directory: str, base: str) -> None:
    """Remove the temporary files of agents killed while building a table (the caller holds
    the creation lock, so none is in use)."""
    for leftover in glob.glob(
        os.path.join(glob.escape(directory), f".{glob.escape(base)}.*{_BUILDING}")
    ):
        with contextlib.suppress(OSError):
            if os.lstat(leftover).st_uid == os.geteuid():
                os.unlink(leftover)


def _open_private(path: str) -> int | None:
    """The existing file at ``path`` opened read-write, or None when there is none."""
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TableError(f"flow table {path} is a symbolic link; refusing it") from exc
        raise TableError(f"cannot open flow table {path}: {exc.strerror}") from exc


def _secure_fd(fd: int, path: str, gid: int | None) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise TableError(f"flow table {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise TableError(
            f"flow table {path} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); refusing it"
        )
    if gid is not None:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o660)
    elif stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)


def _check_trusted_owner(path: str, st: os.stat_result) -> None:
    if st.st_uid not in (0, os.geteuid()):
        raise TableError(
            f"flow table {path} is owned by uid {st.st_uid}, neither root nor this user "
            f"(uid {os.geteuid()}); refusing it"
        )
    if st.st_mode & stat.S_IWOTH:
        raise TableError(f"flow table {path} is writable by others; refusing it")


def _validate_size(path: str, size: int) -> None:
    if size < L.HEADER_SIZE or (size - L.HEADER_SIZE) % L.SLOT_SIZE:
        raise TableError(
            f"flow table {path} has size {size}: not a {L.HEADER_SIZE}-byte header plus whole "
            f"{L.SLOT_SIZE}-byte slots (truncated or corrupt)"
        )


def _map(fd: int, size: int, writable: bool) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)


def _pack_config(cfg: TableConfig) -> bytes:
    area = bytearray(_CONFIG_END - _CONFIG_START)
    struct.pack_into("<II", area, 0, len(cfg.class_map), cfg.fallback_class)
    for i, (tc, cid) in enumerate(cfg.class_map):
        L.CLASS_MAP_ENTRY.pack_into(area, _AREA["class_map"] + i * 8, tc, cid)
    for cid in range(L.MAX_CLASSES):
        area[_AREA["default_level"] + cid] = cfg.default_level(cid)
    for lvl, m in enumerate(cfg.markings):
        L.LEVEL_MARKING_ENTRY.pack_into(
            area, _AREA["level_marking"] + lvl * 8, m.dscp, m.so_priority
        )
    area[_AREA["gate_mode"]] = cfg.gate_mode
    for name in ("gate_min_share", "gate_window_ms", "gate_max_defer_ms"):
        struct.pack_into("<H", area, _AREA[name], getattr(cfg, name))
    return bytes(area)


def _unpack_config(raw: bytes, num_levels: int) -> TableConfig:
    count, fallback = struct.unpack_from("<II", raw, 0)
    if count > L.MAX_CLASS_MAP or not 1 <= num_levels <= L.MAX_LEVELS:
        raise TableError(f"corrupt config area: num_class_map {count}, num_levels {num_levels}")
    class_map = tuple(
        L.CLASS_MAP_ENTRY.unpack_from(raw, _AREA["class_map"] + i * 8) for i in range(count)
    )
    base = _AREA["default_level"]
    defaults = tuple(min(raw[base + cid], num_levels - 1) for cid in range(L.MAX_CLASSES))
    markings = tuple(
        LevelMarking(*L.LEVEL_MARKING_ENTRY.unpack_from(raw, _AREA["level_marking"] + lvl * 8))
        for lvl in range(num_levels)
    )
    mode = raw[_AREA["gate_mode"]]
    gates = [
        struct.unpack_from("<H", raw, _AREA[name])[0]
        for name in ("gate_min_share", "gate_window_ms", "gate_max_defer_ms")
    ]
    if mode > L.GATE_MODE_TUNED or not (gates[0] <= 1000 or gates[0] == L.GATE_UNSET):
        raise TableError(f"corrupt config area: gate_mode {mode}, gate_min_share {gates[0]}")
    try:
        return TableConfig(num_levels, markings, class_map, fallback, defaults, mode, *gates)
    except ValueError as exc:  # a value out of range (its message names the field)
        raise TableError(f"corrupt config area: {exc}") from None


# =====================================================================================
# TEST SUPPORT ONLY: an emulation of the C plugin's side of one slot.
# =====================================================================================


class EmulatedPluginSlot:
    """TEST SUPPORT: claims and drives one slot the way the C plugin does.

    It is not safe against a concurrent real plugin (Python has no compare-and-swap); use it
    only in tests, where it stands in for an NCCL connection.
    """

    def __init__(
        self,
        table: FlowTable,
        *,
        class_id: int = 0,
        traffic_class: int = -1,
        comm_id: int = 0,
        peer_rank: int = -1,
        direction: int = L.DIR_SEND,
        pid: int | None = None,
        pid_ns: int | None = None,
        start_ticks: int | None = None,
        take_closed: bool = False,
    ) -> None:
        self.table = table
        self.index = self._claim(take_closed)
        mm, off = table._mm, L.slot_offset(self.index)
        self._off = off
        # the plugin's: this process's namespace (this table object's PidNamespaces is ours)
        _put_slot(mm, off, "pid_ns", table.pid_namespaces.own if pid_ns is None else pid_ns)
        _put_slot(mm, off, "pid", os.getpid() if pid is None else pid)
        if start_ticks is None:  # the plugin's: this process's start (a pid of another, none)
            start_ticks = table.pid_namespaces.start_of(os.getpid()) if pid is None else 0
        _put_slot(mm, off, "start_ticks", start_ticks)
        for name, value in (
            ("comm_id", comm_id),
            ("peer_rank", peer_rank),
            ("traffic_class", traffic_class),
            ("class_id", class_id),
            ("direction", direction),
            ("bytes", 0),
            ("messages", 0),
            ("open_ns", monotonic_ns()),
            ("last_ns", 0),
            ("applied_level", L.LEVEL_UNSET),
            ("level", L.LEVEL_UNSET),
        ):
            _put_slot(mm, off, name, value)
        self.claim_seq = _get_slot(mm, off, "claim_seq") + 1
        _put_slot(mm, off, "claim_seq", self.claim_seq)
        _put_slot(mm, off, "state", L.SLOT_ACTIVE)

    def _claim(self, take_closed: bool) -> int:
        wanted = (L.SLOT_FREE, L.SLOT_CLOSED) if take_closed else (L.SLOT_FREE,)
        for want in wanted:
            for index in range(self.table.num_slots):
                if self.table.slot_state(index) == want:
                    _put_slot(self.table._mm, L.slot_offset(index), "state", L.SLOT_CLAIMED)
                    return index
        raise TableError("no free slot in the flow table")

    def send(self, nbytes: int) -> int:
        """Account one message of ``nbytes``; return the level in force (plugin's isend path)."""
        mm = self.table._mm
        _put_slot(mm, self._off, "bytes", _get_slot(mm, self._off, "bytes") + nbytes)
        _put_slot(mm, self._off, "messages", _get_slot(mm, self._off, "messages") + 1)
        _put_slot(mm, self._off, "last_ns", monotonic_ns())
        level = self.current_level()
        if level != _get_slot(mm, self._off, "applied_level"):
            _put_slot(mm, self._off, "applied_level", level)
            _put_slot(mm, self._off, "applied_ns", monotonic_ns())
        return level

    def set_peer(self, peer_rank: int) -> None:
        """Fill in the peer rank later, as the plugin does when the receiver's rank note (or
        a receive's first tag) arrives; the plugin claims a send slot with -1 (unknown)."""
        _put_slot(self.table._mm, self._off, "peer_rank", peer_rank)

    def raw_level(self) -> int:
        """The slot's ``level`` word as the agent wrote it (LEVEL_UNSET if never)."""
        return _get_slot(self.table._mm, self._off, "level")

    def current_level(self) -> int:
        """The level the plugin would use now: the slot's, else the class's default."""
        level = self.raw_level()
        if level != L.LEVEL_UNSET:
            return level
        class_id = _get_slot(self.table._mm, self._off, "class_id")
        return self.table.read_config().default_level(class_id)

    def close(self) -> None:
        """ACTIVE -> CLOSED (``bytes`` is final)."""
        _put_slot(self.table._mm, self._off, "state", L.SLOT_CLOSED)


def _put_slot(mm: mmap.mmap, off: int, name: str, value: int) -> None:
    field_off, st = _SLOT[name]
    st.pack_into(mm, off + field_off, value)


def _get_slot(mm: mmap.mmap, off: int, name: str) -> int:
    field_off, st = _SLOT[name]
    value: int = st.unpack_from(mm, off + field_off)[0]
    return value


def default_markings(num_levels: int) -> tuple[LevelMarking, ...]:
    """A plain marking table for tests and last-resort defaults: level 0 = DSCP 46 (EF) ..."""
    dscps: Sequence[int] = (46, 34, 26, 18, 10, 8, 0, 0)
    return tuple(
        LevelMarking(dscps[min(i, len(dscps) - 1)], max(6 - i, 0)) for i in range(num_levels)
    )
