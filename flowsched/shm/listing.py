"""What a node's flow table holds, for people (``flowsched flows``): each NCCL connection with
its process, class, the level the agent wants and the one on its sockets, the marking, bytes
and (from two looks) its rate.

Reads only: the table is opened read-only and nothing is written, so it is safe to run next to
a live agent and live jobs. A slot's owner in another pid namespace (a pod without
``hostPID``) is shown by its pid here when /proc can place it (the agent's own mapping,
:class:`~flowsched.shm.pidns.PidNamespaces`; root sees every process), else by its pid there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from flowsched.model import FlowClass
from flowsched.shm import layout as L
from flowsched.shm.pidns import UNKNOWN
from flowsched.shm.table import (
    LIVE_AGENT_SECONDS,
    FlowTable,
    SlotSnapshot,
    monotonic_ns,
    pid_alive,
)

_STATES = {L.SLOT_ACTIVE: "active", L.SLOT_CLOSED: "closed"}
_DIRECTIONS = {L.DIR_SEND: "send", L.DIR_RECV: "recv"}


@dataclass(frozen=True, slots=True)
class TableSummary:
    """The table's header, as a reader sees it."""

    path: str
    num_slots: int
    num_levels: int
    generation: int
    #: the agent that owns the table (0: none ever attached, or it detached)
    agent_pid: int
    #: seconds since the agent's last heartbeat (None: it never beat)
    heartbeat_age_s: float | None
    #: the agent is running: its pid is set and it beat within LIVE_AGENT_SECONDS
    agent_alive: bool
    #: the agent follows a coordinator (False: its local fallback policy decides)
    coordinator_connected: bool


@dataclass(frozen=True, slots=True)
class ConnectionRow:
    """One connection of the table (a slot's current claim)."""

    slot: int
    claim_seq: int
    state: str
    #: its process as the plugin wrote it (in the process's own pid namespace)
    pid: int
    #: that namespace is not this reader's (a pod's own pid namespace)
    other_namespace: bool
    #: the same process here, when it lives in another pid namespace and /proc placed it
    host_pid: int | None
    #: the process's command name (/proc/PID/comm), when readable here
    command: str | None
    cls: str
    direction: str
    peer_rank: int | None
    traffic_class: int | None
    comm_id: int
    #: the level the agent wrote (None: none yet, the class default applies)
    level: int | None
    #: the level the plugin last put on the sockets (None: none applied yet)
    applied_level: int | None
    #: DSCP of the applied level (None: none applied yet)
    dscp: int | None
    bytes: int
    messages: int
    age_s: float
    idle_s: float
    #: it moved here from a table the process used before (SLOT_FLAG_MOVED)
    moved: bool
    #: its process is gone (the agent frees the slot at its next pass; False: alive or unknown)
    exited: bool
    #: bytes per second between two looks (None: one look only, or the slot was re-claimed)
    rate: float | None = None


def summarize(table: FlowTable, now_ns: int | None = None) -> TableSummary:
    """The header of ``table`` at ``now_ns`` (CLOCK_MONOTONIC; default now)."""
    now_ns = monotonic_ns() if now_ns is None else now_ns
    header = table.header()
    beat = header["heartbeat_ns"]
    age = (now_ns - beat) / 1e9 if beat else None
    flags = header["flags"]
    return TableSummary(
        path=table.path,
        num_slots=header["num_slots"],
        num_levels=header["num_levels"],
        generation=header["generation"],
        agent_pid=header["agent_pid"],
        heartbeat_age_s=age,
        agent_alive=header["agent_pid"] != 0 and age is not None and age < LIVE_AGENT_SECONDS,
        coordinator_connected=bool(flags & L.FLAG_COORDINATOR_CONNECTED),
    )


def connections(
    table: FlowTable, *, include_closed: bool = False, now_ns: int | None = None
) -> list[ConnectionRow]:
    """The connections of ``table`` in slot order: ACTIVE ones, and CLOSED ones (which the
    agent has not reported yet) with ``include_closed``."""
    now_ns = monotonic_ns() if now_ns is None else now_ns
    config = table.read_config()
    rows = []
    for snap in table.slots():
        if snap.state == L.SLOT_CLOSED and not include_closed:
            continue
        applied = None if snap.applied_level == L.LEVEL_UNSET else snap.applied_level
        host_pid = _host_pid(table, snap)
        rows.append(
            ConnectionRow(
                slot=snap.index,
                claim_seq=snap.claim_seq,
                state=_STATES.get(snap.state, str(snap.state)),
                pid=snap.pid,
                other_namespace=table.pid_namespaces.foreign(snap.pid_ns),
                host_pid=host_pid,
                command=_command(host_pid if host_pid is not None else snap.pid, snap, table),
                cls=_class_label(snap.class_id),
                direction=_DIRECTIONS.get(snap.direction, str(snap.direction)),
                peer_rank=snap.peer_rank if snap.peer_rank >= 0 else None,
                traffic_class=snap.traffic_class if snap.traffic_class >= 0 else None,
                comm_id=snap.comm_id,
                level=None if snap.level == L.LEVEL_UNSET else snap.level,
                applied_level=applied,
                dscp=None if applied is None else config.marking(applied).dscp,
                bytes=snap.bytes,
                messages=snap.messages,
                age_s=max(0.0, (now_ns - snap.open_ns) / 1e9),
                idle_s=max(0.0, (now_ns - snap.last_ns) / 1e9),
                moved=bool(snap.flags & L.SLOT_FLAG_MOVED),
                exited=_exited(table, snap, host_pid),
            )
        )
    return rows


def with_rates(
    before: Iterable[ConnectionRow], after: Sequence[ConnectionRow], seconds: float
) -> list[ConnectionRow]:
    """``after`` with each connection's rate over the ``seconds`` since ``before`` (a slot
    claimed again in between is another connection: no rate)."""
    earlier = {(row.slot, row.claim_seq): row.bytes for row in before}
    rated = []
    for row in after:
        sent = earlier.get((row.slot, row.claim_seq))
        rate = None if sent is None or seconds <= 0 else max(0, row.bytes - sent) / seconds
        rated.append(replace(row, rate=rate))
    return rated


def _class_label(class_id: int) -> str:
    try:
        return FlowClass(class_id).label
    except ValueError:
        return f"class {class_id}"


def _host_pid(table: FlowTable, snap: SlotSnapshot) -> int | None:
    namespaces = table.pid_namespaces
    if not namespaces.foreign(snap.pid_ns):
        return None
    here = namespaces.local_pid(snap.pid_ns, snap.pid, snap.open_ns, snap.start_ticks)
    return None if here is None or here == UNKNOWN else here


def _exited(table: FlowTable, snap: SlotSnapshot, host_pid: int | None) -> bool:
    if host_pid is not None:
        return not pid_alive(host_pid)
    return not table.pid_namespaces.foreign(snap.pid_ns) and not pid_alive(snap.pid)


def _command(pid: int, snap: SlotSnapshot, table: FlowTable) -> str | None:
    """``pid``'s command name, when ``pid`` names the slot's process here."""
    if table.pid_namespaces.foreign(snap.pid_ns) and pid == snap.pid:
        return None  # only its pid in its own namespace is known: another process here
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
            return comm.read().strip() or None
    except OSError:
        return None
