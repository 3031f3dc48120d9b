"""The agent's view of its node's flows (sans-IO): plugin connections, SDK flows, linking.

Sources of flows:

* a plugin connection (a table slot, send direction) is its own flow with its class's defaults;
* an SDK flow opened by process P with class C (optionally narrowed to one peer rank).

Links of a flow (``Flow.links``, what the coordinator's policy reads loads of): the node's own
links (its egress ``<node>:tx``) plus, for an SDK flow that names its destination node, that
node's ingress ``<dst_node>:rx`` (see :mod:`flowsched.agent.nic`). Plugin connections know only
the peer rank, not its node, and keep the node's own links.

Linking rule (design item 4): while an SDK flow of class C is open in process P, the plugin
send connections of class C in P (to ``peer`` when given) carry it. Their standalone flows are
closed, the bytes they send from then on count as the SDK flow's progress, and the SDK flow's
level is written into their slots. When several open SDK flows match one connection, it
carries the oldest (the first opened): a connection keeps its SDK flow while that is open, and
when it closes the connection passes to the oldest other open match, if any; with none it
becomes a standalone flow again (new id).

Peers: the plugin learns a send connection's peer rank after the connection starts (its
``peer_rank`` is -1 until the receiver's rank note arrives, and for good in wrapping mode), so
while a connection's peer is -1 and its process has an SDK flow narrowed to a peer, every scan
re-reads the slot's ``peer_rank``; once known, an unlinked connection links to the oldest
matching SDK flow. Receive connections are never flows and never linked: their bytes are the
sending node's progress, and the plugin applies levels to sends only.

The registry only records facts and queues the messages for the coordinator; the service does
the I/O (table writes, SDK pushes, sending batches). Times are wall-clock seconds.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from flowsched.model import Flow, FlowClass
from flowsched.protocol import (
    MAX_PROGRESS,
    RESYNC_FRAME_OPENS,
    U64_MAX,
    FlowClose,
    FlowOpen,
    Flows,
    JobProgress,
    Resync,
)
from flowsched.shm import layout
from flowsched.shm.table import SlotSnapshot

SlotKey = tuple[int, int]
_T = TypeVar("_T")

#: flow opens per ``flows``/``resync`` frame. An agent's open is at most ~3.9 KB on the wire
#: (job and request of 255 four-byte characters, three links of a 128-character node name), so
#: 200 of them stay far below the 1 MiB default frame limit. A full ``resync`` frame tells the
#: coordinator that more of it may follow (RESYNC_FRAME_OPENS): never fewer than that.
MAX_OPENS_PER_FRAME = RESYNC_FRAME_OPENS
#: progress reports (the most a coordinator accepts in one frame) or closes per ``flows``
#: frame, each well under 64 bytes
MAX_ENTRIES_PER_FRAME = MAX_PROGRESS


@dataclass(slots=True)
class SlotConn:
    """One plugin connection (a slot claim) the agent has seen."""

    key: SlotKey
    pid: int  # its owner's process key: the pid, or namespace and pid (PidNamespaces)
    cls: FlowClass
    peer_rank: int
    direction: int
    bytes: int
    base: int  # slot bytes when its current role (own flow or linked) began
    flow_id: int | None = None  # its own flow, when not linked
    linked_to: int | None = None  # the SDK flow carrying it
    #: it moved into the table already open (layout.SLOT_FLAG_MOVED): its bytes when first
    #: seen were carried before this agent saw it
    moved: bool = False
    #: its owner's start (the slot's start_ticks; 0: unknown)
    start_ticks: int = 0


@dataclass(slots=True)
class SdkFlow:
    """Bookkeeping of one SDK flow beyond its :class:`Flow`."""

    pid: int  # its client's process key, as SlotConn.pid
    peer: int | None
    #: its client's start, as SlotConn.start_ticks (0: unknown): a later process given the
    #: same pid (the client exited, its connection lived on) is not its client
    start_ticks: int = 0
    app_sent: int = 0
    slot_bytes_done: int = 0  # bytes of linked slots that have closed or unlinked
    slot_bytes_live: int = 0  # bytes the linked slots moved since they were linked
    slots: set[SlotKey] = field(default_factory=set)

    def sent(self) -> int:
        """Bytes of the flow so far, capped at the protocol's u64 counter."""
        return min(self.app_sent + self.slot_bytes_done + self.slot_bytes_live, U64_MAX)


class FlowRegistry:
    """Tracks the node's flows and queues opens / progress / closes for the coordinator."""

    def __init__(
        self,
        *,
        node: str,
        links: tuple[str, ...],
        id_prefix: int,
        default_deadline: Callable[[FlowClass], float | None] = lambda cls: None,
        links_to: Callable[[str], tuple[str, ...]] | None = None,
        owner_key: Callable[[SlotSnapshot], int] = lambda snap: snap.pid,
    ) -> None:
        self.node = node
        #: a slot's owner as the number the SDK server names its clients by (their pid, or
        #: namespace and pid for a job in a pid namespace of its own: FlowTable.owner_key)
        self._owner_key = owner_key
        self.links = links
        #: links of a flow to a named destination node (default: own links + ``<dst>:rx``)
        self._links_to = links_to or (lambda dst: (*links, f"{dst}:rx"))
        self.flows: dict[int, Flow] = {}
        self.slots: dict[SlotKey, SlotConn] = {}
        self.sdk: dict[int, SdkFlow] = {}
        #: the open SDK flows by what a connection must share with one to carry it (its
        #: process, class and peer, None: not narrowed), oldest first: finding a connection's
        #: carrier looks at those alone, not at every SDK flow of the node
        self._sdk_for: dict[tuple[int, FlowClass, int | None], dict[int, None]] = {}
        #: pid -> its open SDK flows narrowed to a peer (kept as they open and close: the
        #: scan asks it every pass, for every send connection whose peer is still unknown)
        self._narrowed: Counter[int] = Counter()
        #: a plugin connection's own flow -> its slot (set_level finds the slot without a scan)
        self._own_slot: dict[int, SlotKey] = {}
        self.job_index: dict[str, int] = {}
        self._ids = itertools.count(((id_prefix & 0xFFFFFF) << 40) | 1)
        self._default_deadline = default_deadline
        self._pending_opens: dict[int, FlowOpen | None] = {}
        self._closes: list[FlowClose] = []
        self._reported: dict[int, int] = {}
        self.opened_total = 0
        self._closed_flows: list[Flow] = []
        self.closed_total = 0

    # ------------------------------------------------------------------ flows
    def _open(
        self, cls: FlowClass, now: float, links: tuple[str, ...] | None = None, **fields: object
    ) -> Flow:
        links = self.links if links is None else links
        flow = Flow(next(self._ids), cls, now, node=self.node, links=links, **fields)  # type: ignore[arg-type]
        if flow.deadline is None and (rel := self._default_deadline(cls)) is not None:
            flow.deadline = now + rel
        self.flows[flow.flow_id] = flow
        self._pending_opens[flow.flow_id] = None
        self.opened_total += 1
        return flow

    def _close(self, flow_id: int, now: float) -> Flow | None:
        flow = self.flows.pop(flow_id, None)
        if flow is None:
            return None
        if flow_id in self._pending_opens:
            self._pending_opens[flow_id] = _open_message(flow)
        self._closes.append(FlowClose(flow_id, flow.sent, now))
        self._reported.pop(flow_id, None)
        self._own_slot.pop(flow_id, None)
        self.closed_total += 1
        self._closed_flows.append(flow)
        return flow

    def drain_closed(self) -> list[Flow]:
        """Flows closed since the last call (for the local policy's ``release``)."""
        closed, self._closed_flows = self._closed_flows, []
        return closed

    # ------------------------------------------------------------------ SDK side
    def open_sdk(
        self,
        pid: int,
        cls: FlowClass,
        now: float,
        *,
        size: int | None = None,
        deadline: float | None = None,
        consumer_index: int | None = None,
        job: str | None = None,
        request: str | None = None,
        peer: int | None = None,
        dst_node: str | None = None,
        start_ticks: int = 0,
    ) -> tuple[Flow, list[SlotKey]]:
        """Open an SDK flow; returns it and the slots it now carries (their level changes).

        ``dst_node`` (the receiving node) adds that node's ingress link to the flow's links.
        ``start_ticks``: when the client process started (0: unknown); only slots of the
        process that started then (or that do not say) are linked to the flow.
        """
        links = None if dst_node is None or dst_node == self.node else self._links_to(dst_node)
        if peer is not None and peer < 0:
            # -1 is "no peer" (the plugin's unknown peer_rank, which the SDK's rule admits): a
            # flow narrowed to it would link exactly the connections whose peer is unknown,
            # which must never link to a narrowed flow; it narrows nothing instead
            peer = None
        flow = self._open(
            cls,
            now,
            links,
            size=size,
            deadline=deadline,
            consumer_index=consumer_index,
            job=job,
            request=request,
        )
        self.sdk[flow.flow_id] = SdkFlow(pid, peer, start_ticks=start_ticks)
        self._sdk_for.setdefault((pid, cls, peer), {})[flow.flow_id] = None
        if peer is not None:
            self._narrowed[pid] += 1
        linked = []
        for conn in self.slots.values():
            if conn.linked_to is None and self._matches(conn, flow.flow_id):
                self._link(conn, flow.flow_id, now)
                linked.append(conn.key)
        return flow, linked

    def sdk_progress(self, flow_id: int, pid: int, sent: int) -> None:
        """The application reports ``sent`` bytes moved by itself on ``flow_id``."""
        info = self.sdk.get(flow_id)
        if info is not None and info.pid == pid:
            info.app_sent = max(info.app_sent, sent)
            self._refresh_sdk(flow_id)

    def close_sdk(self, flow_id: int, pid: int, sent: int | None, now: float) -> list[SlotKey]:
        """Close an SDK flow; returns the slots it carried, whose level must be rewritten: each
        now carries the oldest other open SDK flow that matches it, else is its own flow again."""
        info = self.sdk.get(flow_id)
        if info is None or info.pid != pid:
            return []
        if sent is not None:
            info.app_sent = max(info.app_sent, sent)
        self._refresh_sdk(flow_id)
        del self.sdk[flow_id]
        match = (pid, self.flows[flow_id].cls, info.peer)
        alike = self._sdk_for[match]
        del alike[flow_id]
        if not alike:
            del self._sdk_for[match]
        if info.peer is not None:
            self._narrowed[pid] -= 1
            if self._narrowed[pid] <= 0:
                del self._narrowed[pid]
        self._close(flow_id, now)
        released = []
        for key in sorted(info.slots):
            conn = self.slots[key]
            conn.linked_to = None
            successor = self._carrier(conn)
            if successor is not None:
                self._link(conn, successor, now)
            else:
                self._start_own_flow(conn, now)
            released.append(key)
        return released

    def close_pid(self, pid: int, now: float) -> list[SlotKey]:
        """The SDK connection of ``pid`` went away: close its flows."""
        released: list[SlotKey] = []
        for flow_id in [fid for fid, info in self.sdk.items() if info.pid == pid]:
            released += self.close_sdk(flow_id, pid, None, now)
        return released

    def job_progress(self, job: str, step: int, layer: int | None = None) -> None:
        """Record the job's current step (the RLI ``L_curr``), and its layer when given
        (``"<job>/layer"``, for layer-indexed flows), as the coordinator publishes them."""
        self.job_index[job] = step
        if layer is not None:
            self.job_index[f"{job}/layer"] = layer

    # ------------------------------------------------------------------ table side
    def observe(
        self, snapshots: Iterable[SlotSnapshot], now: float, mono_ns: int
    ) -> tuple[list[SlotKey], list[SlotKey]]:
        """Apply one scan given as full snapshots (see :meth:`observe_counts`)."""
        by_index = {s.index: s for s in snapshots}
        entries = [(s.index, s.state, s.claim_seq, s.bytes) for s in by_index.values()]
        return self.observe_counts(entries, by_index.get, now, mono_ns)

    def observe_counts(
        self,
        entries: Iterable[tuple[int, int, int, int]],
        fetch: Callable[[int], SlotSnapshot | None],
        now: float,
        mono_ns: int,
    ) -> tuple[list[SlotKey], list[SlotKey]]:
        """Apply one scan of ``(index, state, claim_seq, bytes)`` entries.

        Known ACTIVE connections only update their byte count; anything new or CLOSED is
        re-read consistently with ``fetch(index)``, and so is a send connection whose peer is
        still unknown (-1) while its process has an SDK flow narrowed to a peer. A connection
        missing from the scan, or CLOSED, has ended. Returns (keys of new connections and of
        connections that changed carrier, whose level must be written; ended keys whose slot
        may be freed).
        """
        seen: set[SlotKey] = set()
        changed: list[SlotKey] = []
        ended: list[SlotKey] = []
        narrowed = self._narrowed
        for index, state, seq, nbytes in entries:
            conn = self.slots.get((index, seq))
            if (
                conn is not None
                and conn.peer_rank < 0
                and conn.direction == layout.DIR_SEND
                and conn.pid in narrowed
                and self._learn_peer(conn, fetch(index), now)
            ):
                changed.append(conn.key)
            if conn is None or state == layout.SLOT_CLOSED:
                snap = fetch(index)
                if snap is None:
                    continue
                state, nbytes = snap.state, snap.bytes
                conn = self.slots.get(snap.key)
                if conn is None:
                    conn = self._new_conn(snap, now, mono_ns)
                    changed.append(snap.key)
            seen.add(conn.key)
            if nbytes >= conn.bytes:  # counters only grow; a torn read never moves them back
                self._update_bytes(conn, nbytes)
            if state == layout.SLOT_CLOSED:
                self._end(conn, now)
                ended.append(conn.key)
        for key in [k for k in self.slots if k not in seen]:
            self._end(self.slots[key], now)
        return changed, ended

    def _new_conn(self, snap: SlotSnapshot, now: float, mono_ns: int) -> SlotConn:
        try:
            cls = FlowClass(snap.class_id)
        except ValueError:
            cls = FlowClass.BULK
        pid = self._owner_key(snap)
        conn = SlotConn(snap.key, pid, cls, snap.peer_rank, snap.direction, snap.bytes, 0)
        conn.moved = bool(snap.flags & layout.SLOT_FLAG_MOVED)
        conn.start_ticks = snap.start_ticks
        self.slots[snap.key] = conn
        if conn.direction != layout.DIR_SEND:
            return conn
        carrier = self._carrier(conn)
        if carrier is not None:
            # A moved connection's bytes so far were carried before this agent saw it: only
            # what it carries from now on counts toward the SDK flow.
            self._link(conn, carrier, now, base=None if conn.moved else 0)
            return conn
        opened = now - max(mono_ns - snap.open_ns, 0) / 1e9 if snap.open_ns else now
        self._start_own_flow(conn, opened, base=0)
        return conn

    def _start_own_flow(self, conn: SlotConn, now: float, base: int | None = None) -> None:
        conn.base = conn.bytes if base is None else base
        flow = self._open(conn.cls, now)
        flow.sent = conn.bytes - conn.base
        flow.attrs["slot"] = conn.key[0]
        conn.flow_id = flow.flow_id
        self._own_slot[flow.flow_id] = conn.key

    def _learn_peer(self, conn: SlotConn, snap: SlotSnapshot | None, now: float) -> bool:
        """Take the peer rank the plugin filled in since; link the connection when that makes
        an SDK flow match it. True when it changed carrier."""
        if snap is None or snap.key != conn.key or snap.peer_rank < 0:
            return False
        conn.peer_rank = snap.peer_rank
        if conn.linked_to is not None:
            return False
        carrier = self._carrier(conn)
        if carrier is None:
            return False
        self._link(conn, carrier, now)
        return True

    def _carrier(self, conn: SlotConn) -> int | None:
        """The oldest open SDK flow that ``conn`` should carry (None: none matches): the
        oldest of its process and class, not narrowed or narrowed to its peer, whose client
        is its process (:func:`_same_start`). Ids grow with opening order."""
        if conn.direction != layout.DIR_SEND:
            return None
        found: int | None = None
        for peer in (None, conn.peer_rank) if conn.peer_rank >= 0 else (None,):
            for sdk_id in self._sdk_for.get((conn.pid, conn.cls, peer), ()):
                if _same_start(conn.start_ticks, self.sdk[sdk_id].start_ticks):
                    if found is None or sdk_id < found:
                        found = sdk_id
                    break
        return found

    def _matches(self, conn: SlotConn, sdk_id: int) -> bool:
        info = self.sdk[sdk_id]
        flow = self.flows[sdk_id]
        return (
            conn.direction == layout.DIR_SEND
            and conn.pid == info.pid
            and _same_start(conn.start_ticks, info.start_ticks)
            and conn.cls == flow.cls
            and (info.peer is None or info.peer == conn.peer_rank)
        )

    def _link(self, conn: SlotConn, sdk_id: int, now: float, base: int | None = None) -> None:
        if conn.flow_id is not None:
            self._close(conn.flow_id, now)
            conn.flow_id = None
        conn.base = conn.bytes if base is None else base
        conn.linked_to = sdk_id
        info = self.sdk[sdk_id]
        info.slots.add(conn.key)
        # added, not re-summed: an open (or a close's handover) links every connection of a
        # process at once, and a re-sum per link cost the square of their number
        info.slot_bytes_live += conn.bytes - conn.base
        self.flows[sdk_id].sent = info.sent()

    def _update_bytes(self, conn: SlotConn, nbytes: int) -> None:
        if nbytes == conn.bytes:
            return
        grown, conn.bytes = nbytes - conn.bytes, nbytes
        if conn.flow_id is not None:
            self.flows[conn.flow_id].sent = nbytes - conn.base
        elif conn.linked_to is not None:
            # the per-scan hot path of a flow carried by many connections: add, do not re-sum
            info = self.sdk[conn.linked_to]
            info.slot_bytes_live += grown
            self.flows[conn.linked_to].sent = info.sent()

    def _refresh_sdk(self, sdk_id: int) -> None:
        """Re-sum the linked slots (after a link, unlink or application progress)."""
        info = self.sdk[sdk_id]
        info.slot_bytes_live = sum(self.slots[k].bytes - self.slots[k].base for k in info.slots)
        self.flows[sdk_id].sent = info.sent()

    def _end(self, conn: SlotConn, now: float) -> None:
        del self.slots[conn.key]
        if conn.flow_id is not None:
            self._close(conn.flow_id, now)
        elif conn.linked_to is not None and conn.linked_to in self.sdk:
            info = self.sdk[conn.linked_to]
            info.slots.discard(conn.key)
            info.slot_bytes_done += conn.bytes - conn.base
            self._refresh_sdk(conn.linked_to)

    # ------------------------------------------------------------------ levels
    def level_of_slot(self, key: SlotKey) -> int | None:
        """The level the slot should carry now (None: not decided, leave the slot alone)."""
        conn = self.slots.get(key)
        if conn is None:
            return None
        flow_id = conn.linked_to if conn.linked_to is not None else conn.flow_id
        flow = self.flows.get(flow_id) if flow_id is not None else None
        return flow.level if flow is not None and flow.level >= 0 else None

    def set_level(self, flow_id: int, level: int) -> list[SlotKey]:
        """Record a decided level; returns the slots whose level word must be rewritten."""
        flow = self.flows.get(flow_id)
        if flow is None or flow.level == level:
            return []
        flow.level = level
        if flow_id in self.sdk:
            return sorted(self.sdk[flow_id].slots)
        key = self._own_slot.get(flow_id)
        return [key] if key is not None else []

    # ------------------------------------------------------------------ reporting
    def take_batch(self, *, progress: bool = True) -> Flows | None:
        """Opens, closes (and, with ``progress``, byte counts) since the last batch, or None."""
        opens = []
        for flow_id, message in self._pending_opens.items():
            if message is None:
                message = _open_message(self.flows[flow_id])
            opens.append(message)
            self._reported[flow_id] = message.sent
        ids: list[int] = []
        sents: list[int] = []
        reported = self._reported
        for fid, flow in self.flows.items() if progress else ():
            last = reported.get(fid)
            if last is not None and last != flow.sent:
                ids.append(fid)
                sents.append(flow.sent)
                reported[fid] = flow.sent
        closes, self._closes = self._closes, []
        self._pending_opens = {}
        for c in closes:
            reported.pop(c.id, None)
        if not (opens or ids or closes):
            return None
        return Flows(
            opens=tuple(opens),
            progress_ids=tuple(ids),
            progress_sent=tuple(sents),
            closes=tuple(closes),
        )

    def report_level(self, flow_id: int) -> None:
        """Send ``flow_id``'s open again, with the level it has: the coordinator, which knows
        the flow, answers with its own level where they differ."""
        flow = self.flows.get(flow_id)
        if flow is not None:
            self._pending_opens[flow_id] = _open_message(flow, with_level=True)

    def drop_reports(self) -> None:
        """Forget the opens and closes queued for the coordinator: none is connected to take
        them (the next connection's resync carries the whole flow set)."""
        if self._pending_opens:
            self._pending_opens = {}
        if self._closes:
            self._closes = []

    def levels(self) -> dict[int, int]:
        """Every live flow's level (-1: none yet), by flow id."""
        return {flow_id: flow.level for flow_id, flow in self.flows.items()}

    def resync_opens(self) -> tuple[FlowOpen, ...]:
        """Every live flow, with its current level, for a Resync; clears the pending batch."""
        self.drop_reports()
        opens = tuple(_open_message(f, with_level=True) for f in self.flows.values())
        self._reported = {o.id: o.sent for o in opens}
        return opens


def split_batch(batch: Flows) -> list[Flows]:
    """``batch`` as frames that each fit the frame limit, opens first (a close or progress
    entry must never reach the coordinator before its flow's open)."""
    if len(batch.opens) <= MAX_OPENS_PER_FRAME and (
        len(batch.progress_ids) + len(batch.closes) <= MAX_ENTRIES_PER_FRAME
    ):
        return [batch]
    frames = [Flows(opens=part) for part in _chunks(batch.opens, MAX_OPENS_PER_FRAME)]
    frames += [
        Flows(progress_ids=ids, progress_sent=sents)
        for ids, sents in zip(
            _chunks(batch.progress_ids, MAX_ENTRIES_PER_FRAME),
            _chunks(batch.progress_sent, MAX_ENTRIES_PER_FRAME),
            strict=True,
        )
    ]
    frames += [Flows(closes=part) for part in _chunks(batch.closes, MAX_ENTRIES_PER_FRAME)]
    return frames


def resync_frames(opens: tuple[FlowOpen, ...]) -> list[Resync | Flows]:
    """A complete flow set as frames that each fit the frame limit: a ``resync`` with the first
    opens, then ``flows`` frames of opens alone with the rest, before any other frame. The
    coordinator keeps the node's flows the ``resync`` did not name until the first frame that
    is not such a continuation (a full ``resync`` may be continued: RESYNC_FRAME_OPENS), so a
    flow named in a continuation keeps its state there; then it drops the others."""
    parts = list(_chunks(opens, MAX_OPENS_PER_FRAME)) or [()]
    frames: list[Resync | Flows] = [Resync(parts[0])]
    frames += [Flows(opens=part) for part in parts[1:]]
    return frames


def _chunks(items: tuple[_T, ...], size: int) -> Iterable[tuple[_T, ...]]:
    return (items[start : start + size] for start in range(0, len(items), size))


def _open_message(flow: Flow, *, with_level: bool = False) -> FlowOpen:
    return FlowOpen(
        id=flow.flow_id,
        cls=flow.cls,
        opened_at=flow.opened_at,
        sent=flow.sent,
        size=flow.size,
        deadline=flow.deadline,
        job=flow.job,
        consumer_index=flow.consumer_index,
        request=flow.request,
        links=flow.links,
        level=flow.level if with_level and flow.level >= 0 else None,
    )


#: jobs one owner (a uid) may have reported at once; its oldest is forgotten beyond this
MAX_JOBS_PER_OWNER = 256
#: jobs a node keeps at once, all owners together (its oldest is forgotten beyond this)
MAX_JOBS = 4096
#: a job that reported no progress for this long is forgotten (seconds)
JOB_TTL = 600.0


@dataclass(slots=True)
class _Job:
    owner: int | None
    update: JobProgress
    seen: float


class JobTable:
    """The latest progress of each job on a node: scoped to its owner, bounded, expiring.

    A job name from an SDK client is scoped to the client's uid (``"1000/train"``): another
    user's client can neither set this job's step nor grow its table. Each owner keeps at most
    ``per_owner`` jobs and the node ``total``; beyond that the least recently updated goes.
    Jobs without progress for ``ttl`` seconds are dropped by :meth:`expire`. Dropped names are
    returned so that the caller forgets them elsewhere (the local policy's job index).
    """

    def __init__(
        self,
        *,
        per_owner: int = MAX_JOBS_PER_OWNER,
        total: int = MAX_JOBS,
        ttl: float = JOB_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._per_owner = per_owner
        self._total = total
        self._ttl = ttl
        self._clock = clock
        self._jobs: dict[str, _Job] = {}  # least recently updated first
        self._by_owner: dict[int | None, dict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    @staticmethod
    def scoped(owner: int | None, job: str) -> str:
        """The cluster-wide name of ``owner``'s job ``job`` (unscoped when owner is None)."""
        return job if owner is None else f"{owner}/{job}"

    def record(
        self, owner: int | None, job: str, step: int, layer: int | None
    ) -> tuple[JobProgress, list[str]]:
        """Record progress; returns the scoped message and the names it made room by dropping."""
        name = self.scoped(owner, job)
        update = JobProgress(name, step, layer)
        self._drop(name)
        dropped: list[str] = []
        mine = self._by_owner.setdefault(owner, {})
        if len(mine) >= self._per_owner:
            dropped.append(next(iter(mine)))
        elif len(self._jobs) >= self._total:
            dropped.append(next(iter(self._jobs)))
        for old in dropped:
            self._drop(old)
        self._jobs[name] = _Job(owner, update, self._clock())
        self._by_owner.setdefault(owner, {})[name] = None
        return update, dropped

    def end(self, owner: int | None, job: str, step: int, layer: int | None) -> JobProgress:
        """``owner``'s job ``job`` ended: forget it; returns the scoped ``done`` message."""
        name = self.scoped(owner, job)
        self._drop(name)
        return JobProgress(name, step, layer, done=True)

    def expire(self) -> list[str]:
        """Drop the jobs without progress for ``ttl`` seconds; return their names."""
        limit = self._clock() - self._ttl
        stale = list(itertools.takewhile(lambda n: self._jobs[n].seen < limit, self._jobs))
        for name in stale:
            self._drop(name)
        return stale

    def latest(self) -> list[JobProgress]:
        """The latest progress of every job (for a resync)."""
        return [job.update for job in self._jobs.values()]

    def _drop(self, name: str) -> None:
        job = self._jobs.pop(name, None)
        if job is not None:
            owned = self._by_owner[job.owner]
            del owned[name]
            if not owned:
                del self._by_owner[job.owner]


def _same_start(slot: int, client: int) -> bool:
    """Whether a slot's owner and an SDK client, of the same pid, are the same process: their
    starts agree, or one of them is unknown (a plugin or an agent that could not tell)."""
    return not slot or not client or slot == client
