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
from flowsched.shm.pidns import UNKNOWN, PidNamespaces
from flowsched.shm.table import (
    LIVE_AGENT_SECONDS,
    FlowTable,
    SlotSnapshot,
    TableConfig,
    TableError,
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
    #: why the config area (the DSCP of each level) could not be read; None: it was
    config_problem: str | None = None


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
    #: its process as this reader can tell: "running", "exited" (the agent frees the slot at
    #: its next pass), "not found" (in another pid namespace that /proc here does not show:
    #: exited, or, read from inside a pod, another pod's) or "unknown" (/proc cannot tell)
    process: str
    #: bytes per second between two looks (None: one look only, or the slot was re-claimed)
    rate: float | None = None
    #: the SDK flow this connection carries, as the agent listed it (None: its own flow, or
    #: not asked; :func:`flowsched.client.list_flows`)
    sdk_flow: int | None = None


def summarize(
    table: FlowTable, now_ns: int | None = None, config_problem: str | None = None
) -> TableSummary:
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
        config_problem=config_problem,
    )


def read_config(table: FlowTable) -> tuple[TableConfig | None, str | None]:
    """The table's config area, or None and why it cannot be read (an agent that died while
    writing it, a corrupt value): the connections are listed without their DSCPs then."""
    try:
        return table.read_config(), None
    except TableError as exc:
        return None, str(exc)


def connections(
    table: FlowTable,
    *,
    include_closed: bool = False,
    now_ns: int | None = None,
    config: TableConfig | None = None,
) -> list[ConnectionRow]:
    """The connections of ``table`` in slot order: ACTIVE ones, and CLOSED ones (which the
    agent has not reported yet) with ``include_closed``; the DSCP of each level from
    ``config`` (None: the table's, when it can be read; else no DSCPs)."""
    now_ns = monotonic_ns() if now_ns is None else now_ns
    if config is None:
        config, _ = read_config(table)
    rows = []
    for snap in table.slots():
        if snap.state == L.SLOT_CLOSED and not include_closed:
            continue
        applied = None if snap.applied_level == L.LEVEL_UNSET else snap.applied_level
        host_pid, process = _process(table, snap)
        rows.append(
            ConnectionRow(
                slot=snap.index,
                claim_seq=snap.claim_seq,
                state=_STATES.get(snap.state, str(snap.state)),
                pid=snap.pid,
                other_namespace=table.pid_namespaces.foreign(snap.pid_ns),
                host_pid=host_pid,
                command=_command(snap.pid if host_pid is None else host_pid, process),
                cls=_class_label(snap.class_id),
                direction=_DIRECTIONS.get(snap.direction, str(snap.direction)),
                peer_rank=snap.peer_rank if snap.peer_rank >= 0 else None,
                traffic_class=snap.traffic_class if snap.traffic_class >= 0 else None,
                comm_id=snap.comm_id,
                level=None if snap.level == L.LEVEL_UNSET else snap.level,
                applied_level=applied,
                dscp=None if applied is None or config is None else config.marking(applied).dscp,
                bytes=snap.bytes,
                messages=snap.messages,
                age_s=max(0.0, (now_ns - snap.open_ns) / 1e9),
                idle_s=max(0.0, (now_ns - snap.last_ns) / 1e9),
                moved=bool(snap.flags & L.SLOT_FLAG_MOVED),
                process=process,
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


def _process(table: FlowTable, snap: SlotSnapshot) -> tuple[int | None, str]:
    """The slot's process here (when it is in another pid namespace and /proc placed it) and
    what this reader can tell of it (see :attr:`ConnectionRow.process`)."""
    namespaces = table.pid_namespaces
    if not namespaces.foreign(snap.pid_ns):
        return None, _running(namespaces, snap.pid, snap.start_ticks)
    here = namespaces.local_pid(snap.pid_ns, snap.pid, snap.open_ns, snap.start_ticks)
    if here is None:
        return None, "not found"
    if here == UNKNOWN:
        return None, "unknown"
    return here, _running(namespaces, here, snap.start_ticks)


def _running(namespaces: PidNamespaces, pid: int, start_ticks: int) -> str:
    """ "running" when ``pid`` lives and, where both starts are known, is the process that
    started at ``start_ticks`` (else its pid was reused: "exited")."""
    if not pid_alive(pid):
        return "exited"
    started = namespaces.start_of(pid)
    return "exited" if start_ticks and started and started != start_ticks else "running"


def _command(pid: int, process: str) -> str | None:
    """The command name of the slot's process, ``pid`` here, while it runs, each character
    that is not printable shown as ``?`` (as ``ps`` does): a process names itself, and
    another user's escape sequences must not reach the terminal of whoever lists the table."""
    if process != "running":
        return None
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
            name = comm.read().rstrip("\n")
    except OSError:
        return None
    return "".join(char if char.isprintable() else "?" for char in name).strip() or None
