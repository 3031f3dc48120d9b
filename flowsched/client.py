"""Application SDK: tell the node agent what NCCL cannot, and learn the marking to use.

>>> from flowsched import client
>>> with client.flow("param_sync", bytes=14 << 30, deadline=time.time() + 30) as f:
...     transfer.SocketMarker(sock).follow(f)   # IP_TOS or IPV6_TCLASS, SO_PRIORITY, promotions
...     ...                                                        # move the bytes
...     f.progress(sent)                                           # optional
>>> client.job_progress("job-7", step=12, layer=3)

While the ``with`` block runs, the agent reports the flow to the coordinator, and the NCCL
connections of the same class in this process (optionally only those to ``peer``) carry it:
their bytes count as its progress and its deadline drives their level. The handle's
:attr:`FlowHandle.dscp`, :attr:`FlowHandle.tos`, :attr:`FlowHandle.so_priority` and
:attr:`FlowHandle.nccl_traffic_class` always hold the current marking; listeners registered
with :meth:`FlowHandle.add_listener` are called (from the SDK's reader thread) on every change.

The agent is found through the unix socket named by ``FLOWSCHED_SOCKET`` (default
:func:`default_socket_path`). With no agent, the SDK degrades to the class's static default
from the embedded default policy, logs that once, and never raises into the application. It
does the same, with a warning, rather than use a socket whose directory another user owns or can
write, or one served by a process running as neither root, this user nor
``$FLOWSCHED_AGENT_UID`` (docs/security.md).
Open flows are re-opened (with new ids) when the agent restarts, or adopted when an agent
first appears (at the default path found anew at each try, so also a root agent that starts
after a user's process); a flow is closed at the agent when its process disconnects. The last
:func:`job_progress` of each job not yet done (the :data:`REMEMBERED_JOBS` latest jobs) is sent
again on every new connection, before the flows are re-opened.

No call waits on a slow agent for long: ``open`` waits at most :data:`OPEN_TIMEOUT` for its
answer (an answer that comes later is still taken, or its flow closed), and messages go
through a per-connection queue that a writer thread drains (progress of one flow coalesced),
so a stalled agent never blocks ``progress``, ``close`` or :func:`job_progress`; past
:data:`SEND_QUEUE_LIMIT` queued bytes the connection is given up and re-made. A forked child
(a DataLoader worker) makes its own connection: it never uses its parent's. Listeners run on
the connection's reader thread: they must not block, nor call the SDK.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import numbers
import operator
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flowsched import rundir
from flowsched.model import FlowClass
from flowsched.protocol import U64_MAX, sdk

log = logging.getLogger("flowsched.client")

#: seconds ``open`` waits for the agent's answer before the flow runs at its static default
OPEN_TIMEOUT = 2.0
RECONNECT_INTERVAL = 1.0
#: bytes queued for an agent that does not read before the connection is given up (the agent
#: then closes its flows, and they are re-opened on the next connection)
SEND_QUEUE_LIMIT = 1 << 20
#: opens whose answer came too late that are still remembered (their flows adopted or closed)
LATE_OPENS = 1024
#: a write never waits, nor raises SIGPIPE where the application left it at its default (an
#: agent gone: EPIPE instead, as for the plugin's writes)
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
#: jobs whose last progress a connection sends again to a new agent connection (the latest)
REMEMBERED_JOBS = 64


def default_socket_path() -> str:
    """``$FLOWSCHED_SOCKET``, else the agent's socket in the runtime directories, in the order
    of :func:`flowsched.rundir.client_path`: ``/run/flowsched/agent.sock`` for root; for a
    user, ``$XDG_RUNTIME_DIR/flowsched/agent.sock`` when there, else the root agent's
    ``/run/flowsched/agent.sock`` when there (a ``--group`` member)."""
    return rundir.client_path(rundir.SOCKET_NAME, "FLOWSCHED_SOCKET")


@dataclass(frozen=True, slots=True)
class Marking:
    """Level and its wire marking.

    ``decided_at`` (wall seconds) and ``decided_ns`` (CLOCK_MONOTONIC ns, comparable only on the
    coordinator's machine) say when the coordinator decided the level; None when unknown (the
    first level, a local decision, an older agent). They do not take part in equality.
    """

    level: int
    dscp: int
    so_priority: int
    nccl_traffic_class: int | None = None
    decided_at: float | None = field(default=None, compare=False)
    decided_ns: int | None = field(default=None, compare=False)


@functools.cache
def static_marking(cls: FlowClass) -> Marking:
    """The class's static default level and marking from the embedded default policy.

    A flow shows it until the agent answers its open, or for good without an agent. Cached,
    and read only then: parsing the policy file takes tens of ms the first time in a process
    (its imports) and about a millisecond after that, with the GIL held.
    """
    try:
        from flowsched import policyfile

        cfg = policyfile.embedded_default()
        level = cfg.classes[cls].default_level
        mark = cfg.levels[level]
        tcs = cfg.classes[cls].traffic_classes
        return Marking(level, mark.dscp, mark.so_priority, tcs[0] if tcs else None)
    except Exception:  # the SDK never raises into the application for a missing default
        log.debug("embedded default policy unavailable", exc_info=True)
        return Marking(0 if cls is FlowClass.TP else 7, 46 if cls is FlowClass.TP else 0, 0)


Listener = Callable[["FlowHandle"], None]


class FlowHandle:
    """One open SDK flow (yielded by :func:`flow`). Thread-safe."""

    def __init__(self, cls: FlowClass, conn: AgentConnection | None) -> None:
        self.cls = cls
        self.id: int | None = None
        #: the agent's marking; None until it answers (the class's static default stands in:
        #: :attr:`marking`), so that an open the agent answers never parses the policy file
        self._marking: Marking | None = None
        self._conn = conn
        self._sent = 0
        self._closed = False
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._request: sdk.Open | None = None  # to re-open the flow at a restarted agent
        _all_handles.add(self)  # its lock is made anew in a forked child

    # ------------------------------------------------------------ marking
    @property
    def connected(self) -> bool:
        """True while the flow is open at an agent. False before any agent acknowledged it
        (the class's static default marking) and after its connection was lost (the last
        marking the agent gave, until the flow is re-opened)."""
        return self.id is not None

    @property
    def marking(self) -> Marking:
        """The current level and marking (the class's static default until the agent gave
        one)."""
        marking = self._marking
        return static_marking(self.cls) if marking is None else marking

    @property
    def level(self) -> int:
        """Current level (0 = most urgent)."""
        return self.marking.level

    @property
    def dscp(self) -> int:
        """DSCP code point (0..63) to put on this flow's packets now."""
        return self.marking.dscp

    @property
    def tos(self) -> int:
        """IP TOS / IPv6 traffic class / RoCE GRH traffic class byte: DSCP << 2."""
        return self.marking.dscp << 2

    @property
    def so_priority(self) -> int:
        """SO_PRIORITY to set (after IP_TOS, which overwrites it on Linux)."""
        return self.marking.so_priority

    @property
    def nccl_traffic_class(self) -> int | None:
        """The NCCL trafficClass the policy maps to this flow's class, if any."""
        return self.marking.nccl_traffic_class

    @property
    def decided_ns(self) -> int | None:
        """CLOCK_MONOTONIC ns at which the coordinator decided the current level (None when
        unknown). Comparable only with monotonic times of the coordinator's machine."""
        return self.marking.decided_ns

    @property
    def decided_at(self) -> float | None:
        """Wall-clock seconds at which the coordinator decided the current level, or None."""
        return self.marking.decided_at

    def add_listener(self, callback: Listener) -> None:
        """Call ``callback(handle)`` on every marking change (from the SDK's reader thread)."""
        with self._lock:
            self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        """Stop calling ``callback``."""
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def _set_marking(self, marking: Marking) -> None:
        with self._lock:
            previous = self._marking
            self._marking = marking
            listeners = list(self._listeners)
        if not listeners:
            return
        shown = static_marking(self.cls) if previous is None else previous  # until now
        if marking != shown:
            for callback in listeners:
                try:
                    callback(self)
                except Exception:
                    log.exception("flowsched listener failed")

    # ------------------------------------------------------------ progress
    def progress(self, sent: int) -> None:
        """Report that ``sent`` bytes of this flow have been sent so far (absolute count).

        Raises:
            ValueError: ``sent`` is not an integer in 0..2**64-1.
        """
        sent = _byte_count(sent, "sent")
        with self._lock:
            self._sent = max(self._sent, sent)
        self._report()

    def add_bytes(self, nbytes: int) -> None:
        """Report ``nbytes`` more bytes sent (atomic: concurrent calls all count).

        Raises:
            ValueError: ``nbytes`` is negative, or the total leaves 0..2**64-1.
        """
        nbytes = _byte_count(nbytes, "nbytes")
        with self._lock:
            self._sent = _byte_count(self._sent + nbytes, "the total of add_bytes")
        self._report()

    def _report(self) -> None:
        flow_id = self.id
        if self._conn is not None and flow_id is not None:
            self._conn.send(sdk.Progress(flow_id, self._sent))  # the latest total, at send time

    def close(self) -> None:
        """Close the flow at the agent (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._conn is not None:
            flow_id = self._conn.forget(self)
            if flow_id is not None:
                self._conn.send(sdk.Close(flow_id, self._sent))


class _Sender:
    """Writes one agent socket's frames in order without blocking the caller.

    A frame goes straight to the kernel (``MSG_DONTWAIT``) when nothing is queued before it;
    otherwise it is queued, and the writer thread (started with the sender) sends the queue.
    A queued ``progress`` is kept once per flow and carries the flow's latest count when it
    is sent. Beyond :data:`SEND_QUEUE_LIMIT` queued bytes the agent is taken to be stuck:
    :meth:`send` shuts the socket down (the reader thread then drops the connection).
    """

    def __init__(self, sock: socket.socket, namespace_fd: int | None = None) -> None:
        self.sock = sock
        #: a descriptor of this process's pid namespace, passed with the first frame and
        #: closed (the agent places a client in a namespace of its own by it)
        self._namespace_fd = namespace_fd
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        #: frames, or (a flow id whose latest progress is in ``_progress``, the bytes counted
        #: for it in ``_queued``)
        self._queue: deque[bytes | tuple[int, int]] = deque()
        self._queued = 0  # bytes of the entries in ``_queue``, as counted when queued
        self._progress: dict[int, int] = {}
        self._writing = False  # the writer thread is sending a frame it took off the queue
        self._stopped = False
        threading.Thread(target=self._write_queue, name="flowsched-sdk-writer", daemon=True).start()

    @property
    def backed_up(self) -> bool:
        """Whether frames wait for the agent to read (the kernel's buffer is full)."""
        return bool(self._queue) or self._writing

    def send(self, message: sdk.SdkMessage) -> bool:
        """Send or queue ``message``; False when the connection is (now) unusable."""
        with self._lock:
            if self._stopped:
                return False
            if isinstance(message, sdk.Progress) and message.id in self._progress:
                self._progress[message.id] = message.sent  # coalesced with the queued one
                return True
            if isinstance(message, sdk.Close):
                self._progress.pop(message.id, None)  # the close carries the count
            data = sdk.encode(message)
            if not self._queue and not self._writing:
                try:
                    sent = self._send_now(data)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return False
                if sent == len(data):
                    return True
                self._queue.append(data[sent:])  # the rest of this frame goes first
                self._queued += len(data) - sent
            elif isinstance(message, sdk.Progress):
                self._progress[message.id] = message.sent
                self._queue.append((message.id, len(data)))
                self._queued += len(data)
            else:
                self._queue.append(data)
                self._queued += len(data)
            if self._queued <= SEND_QUEUE_LIMIT:
                self._ready.notify()
                return True
        log.warning(
            "flowsched agent at %s has not read %d queued bytes: giving the connection up "
            "(its flows are re-opened on the next one)", _socket_name(self.sock), self._queued,
        )  # fmt: skip
        self.stop()
        return False

    def _send_now(self, data: bytes) -> int:
        """Send what the kernel takes of ``data`` without waiting; the first frame carries
        the namespace descriptor (an agent of an earlier release never reads it, and the
        kernel closes it)."""
        fd, self._namespace_fd = self._namespace_fd, None
        if fd is None:
            return self.sock.send(data, _SEND_FLAGS)
        try:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            return self.sock.sendmsg([data], rights, _SEND_FLAGS)
        finally:
            os.close(fd)

    def stop(self) -> None:
        """Drop the queue, end the writer thread and shut the socket down (idempotent)."""
        with self._lock:
            if self._namespace_fd is not None:
                os.close(self._namespace_fd)
                self._namespace_fd = None
            self._stopped = True
            self._queue.clear()
            self._progress.clear()
            self._queued = 0
            self._ready.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a writer blocked in sendall

    def _write_queue(self) -> None:
        while (data := self._next_frame()) is not None:
            try:
                self.sock.sendall(data, socket.MSG_NOSIGNAL)  # only this thread waits
            except OSError:
                self.stop()  # the reader thread sees the end and drops the connection
                return
            finally:
                with self._lock:
                    self._writing = False

    def _next_frame(self) -> bytes | None:
        with self._lock:
            while True:
                while not self._queue and not self._stopped:
                    self._ready.wait()
                if self._stopped:
                    return None
                entry = self._queue.popleft()
                if isinstance(entry, tuple):
                    flow_id, counted = entry
                    self._queued -= counted  # also when skipped: it leaves the queue
                    sent = self._progress.pop(flow_id, None)
                    if sent is None:  # closed since: its close carried the count
                        continue
                    data = sdk.encode(sdk.Progress(flow_id, sent))
                else:
                    data = entry
                    self._queued -= len(data)
                self._writing = True
                return data


def _socket_name(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername())
    except OSError:
        return "its socket"


class AgentConnection:
    """The process's connection to its node agent (one per socket path; thread-safe).

    ``path`` None is the default path, decided again at each connection attempt
    (:func:`default_socket_path`): flows opened by a user's process before any agent ran
    reach a root agent that starts later (which serves ``/run/flowsched``, not the user's own
    runtime directory)."""

    def __init__(self, path: str | None) -> None:
        self._default_path = path is None
        self.path = default_socket_path() if path is None else path
        self._sock: socket.socket | None = None
        self._sender: _Sender | None = None
        self._state_lock = threading.Lock()
        self._refs = itertools.count(1)
        #: open requests waiting for their answer: ref -> (answered, answer, handle)
        self._pending: dict[int, tuple[threading.Event, list[sdk.SdkMessage], FlowHandle]] = {}
        #: open requests answered too late (or not waited for): ref -> handle, oldest first
        self._late: dict[int, FlowHandle] = {}
        self._handles: dict[int, FlowHandle] = {}
        self._live: set[FlowHandle] = set()
        self._last_attempt = -RECONNECT_INTERVAL
        #: (path, problem) pairs already logged: each is logged once
        self._warned: set[tuple[str, str]] = set()
        #: the last progress of each job not yet done, least recently reported first
        self._jobs: dict[str, sdk.JobProgress] = {}
        self._closed = False
        self._reconnecting = False
        self._refusal: str | None = None

    def ensure_connected(self) -> bool:
        """Connect if not connected (at most once per RECONNECT_INTERVAL); True if connected.

        The default path is found again at each attempt, and where a user has both its own
        socket and the root agent's, each is tried in turn (see :func:`rundir.client_paths`)."""
        with self._state_lock:
            if self._sock is not None:
                return True
            now = time.monotonic()
            if self._closed or now - self._last_attempt < RECONNECT_INTERVAL:
                return False
            self._last_attempt = now
            places = [self.path]
            if self._default_path:
                places = rundir.client_paths(rundir.SOCKET_NAME, "FLOWSCHED_SOCKET")
            for path in places:
                sock = self._connect(path)
                if sock is not None:
                    break
            else:
                self.path = places[0]
                return False
            self.path = path
            self._sock = sock
            sender = self._sender = _Sender(sock, _own_pid_namespace())
            jobs = list(self._jobs.values())
        threading.Thread(
            target=self._reader, args=(sock,), name="flowsched-sdk", daemon=True
        ).start()
        for message in jobs:  # a restarted agent knows no job's step until the next report
            sender.send(message)
        return True

    def _connect(self, path: str) -> socket.socket | None:
        """A connection to a trusted agent at ``path``, or None (the problem logged once)."""
        try:
            sock = _connect_trusted(path, OPEN_TIMEOUT)
        except AgentUnavailable as exc:
            self._warn(path, exc.problem, f"{exc}; using static default levels")
            return None
        sock.settimeout(None)
        return sock

    def _warn(self, path: str, problem: str, text: str) -> None:
        if (path, problem) not in self._warned:
            self._warned.add((path, problem))
            log.warning("%s", text)

    def send(self, message: sdk.SdkMessage) -> bool:
        """Send one message without waiting on the agent; False when not connected or the
        connection is being given up (see :class:`_Sender`)."""
        sender = self._sender
        return sender is not None and sender.send(message)

    def report_job(self, message: sdk.JobProgress) -> bool:
        """Send ``message`` (connecting first if need be) and keep it, until its job is done,
        for the next connection; False when no agent got it."""
        sent = self.ensure_connected() and self.send(message)
        with self._state_lock:
            self._jobs.pop(message.job, None)
            if not message.done:
                self._jobs[message.job] = message
                if len(self._jobs) > REMEMBERED_JOBS:
                    del self._jobs[next(iter(self._jobs))]
        return sent

    def open(self, request: sdk.Open, handle: FlowHandle) -> sdk.Opened | None:
        """Send ``open`` and wait (at most :data:`OPEN_TIMEOUT`) for ``opened``; None on error
        or timeout, and at once when the agent is not reading.

        The reader thread gives ``handle`` its id and marking the moment ``opened`` arrives,
        before it reads the next frame: a ``level`` the agent pushes right after ``opened``
        is never lost, nor overwritten by the older marking ``opened`` carried. An ``opened``
        that comes after this returned is still given to ``handle`` (or its flow closed, if
        the handle was closed or re-opened meanwhile): no flow is left open at the agent.
        """
        event = threading.Event()
        box: list[sdk.SdkMessage] = []
        with self._state_lock:
            self._pending[request.ref] = (event, box, handle)
        sender = self._sender
        try:
            if not self.send(request) or sender is None or sender.backed_up:
                pass  # the agent is not reading: the answer, if any, is taken when it comes
            else:
                event.wait(OPEN_TIMEOUT)
        finally:
            with self._state_lock:
                self._pending.pop(request.ref, None)
                if not box and self._sender is sender and sender is not None:
                    self._late[request.ref] = handle
                    while len(self._late) > LATE_OPENS:
                        del self._late[next(iter(self._late))]
        if not box:
            return None
        reply = box[0]
        if isinstance(reply, sdk.Error):
            log.warning("flowsched agent refused the flow: %s", reply.reason)
            return None
        assert isinstance(reply, sdk.Opened)
        return reply

    def next_ref(self) -> int:
        """A fresh request reference."""
        return next(self._refs) & sdk.U32_MAX

    def track(self, handle: FlowHandle) -> None:
        """Keep ``handle`` open here: it is re-opened if the agent restarts (or first appears)."""
        with self._state_lock:
            if handle.id is not None and self._handles.get(handle.id) is not handle:
                handle.id = None  # from a connection that ended before this: re-open it
            self._live.add(handle)
            start = self._sock is None
        if start:
            self._start_reconnecting()

    def forget(self, handle: FlowHandle) -> int | None:
        """The flow is closed: stop routing level pushes to it and stop re-opening it; returns
        its id at the agent (None when it has none), read under the same lock as a late
        ``opened`` gives it one (so one of the two closes it there)."""
        with self._state_lock:
            self._live.discard(handle)
            flow_id = handle.id
            if flow_id is not None:
                self._handles.pop(flow_id, None)
            return flow_id

    def _start_reconnecting(self) -> None:
        with self._state_lock:
            if self._reconnecting or self._closed or not self._live:
                return
            self._reconnecting = True
        threading.Thread(
            target=self._reconnect_loop, name="flowsched-sdk-reconnect", daemon=True
        ).start()

    def _reconnect_loop(self) -> None:
        try:
            while not self._closed and self._live:
                time.sleep(RECONNECT_INTERVAL)
                if self.ensure_connected():
                    with self._state_lock:
                        handles = list(self._live)
                    for handle in handles:
                        self._reopen(handle)
                    return
        finally:
            with self._state_lock:
                self._reconnecting = False
                # a connection that ended while this thread ran (refused at the connection
                # cap, or the agent gone again during the re-opens) found it running and
                # left the retry to it: retry here, or nothing would while flows stay open
                lost = self._sock is None
            if lost:
                self._start_reconnecting()

    def _reopen(self, handle: FlowHandle) -> None:
        # a handle with an id was opened on this connection already (by the application,
        # on a connection one of its own calls made before this thread woke)
        if handle._request is None or handle.id is not None:
            return
        request = dataclasses.replace(handle._request, ref=self.next_ref())
        reply = self.open(request, handle)
        if reply is None or handle.id != reply.id:
            return
        if handle._closed:  # closed while we were re-opening it
            self.send(sdk.Close(reply.id, handle._sent))
            self.forget(handle)
            return
        if handle._sent:
            self.send(sdk.Progress(reply.id, handle._sent))
        log.info("flowsched: flow re-opened at the agent as %d", reply.id)

    def _reader(self, sock: socket.socket) -> None:
        decoder = sdk.SdkDecoder("client")
        try:
            while data := sock.recv(65536):
                decoder.feed(data)
                while (message := decoder.next_message()) is not None:
                    self._dispatch(message)
        except (OSError, sdk.SdkProtocolError) as exc:
            log.warning("flowsched agent connection lost: %s", exc)
        self._drop(sock)

    def _dispatch(self, message: sdk.SdkMessage) -> None:
        ref = getattr(message, "ref", None)
        if isinstance(message, sdk.Opened | sdk.Error) and ref is not None:
            self._answer(ref, message)
        elif isinstance(message, sdk.Error):  # about the connection (a cap): it closes next
            if message.reason != self._refusal:
                self._refusal = message.reason
                log.warning("flowsched agent refused the connection (%s): %s; using static "
                            "default levels", message.code, message.reason)  # fmt: skip
        elif isinstance(message, sdk.Level):
            with self._state_lock:
                handle = self._handles.get(message.id)
            if handle is not None:
                old = handle.marking.nccl_traffic_class
                marking = Marking(
                    message.level,
                    message.dscp,
                    message.so_priority,
                    old,
                    message.decided_at,
                    message.decided_ns,
                )
                handle._set_marking(marking)

    def _answer(self, ref: int, message: sdk.Opened | sdk.Error) -> None:
        """An ``opened`` or a refusal for request ``ref``: to the waiting ``open``, or to a
        handle whose ``open`` stopped waiting; an ``opened`` nobody takes is closed."""
        opened = message if isinstance(message, sdk.Opened) else None
        with self._state_lock:
            pending = self._pending.get(ref)
            late = self._late.pop(ref, None) if pending is None else None
            handle = pending[2] if pending is not None else late
            adopt = opened is not None and handle is not None
            if adopt and late is not None and late._closed:
                adopt = False  # closed meanwhile
            if adopt and handle is not None and handle.id is not None:
                adopt = False  # it has a flow on this connection already: one is enough
            if adopt:
                assert opened is not None and handle is not None
                handle.id = opened.id
                self._handles[opened.id] = handle
            if pending is not None:
                pending[1].append(message)
        if opened is None:
            if pending is not None:
                pending[0].set()
            return
        if not adopt:
            self.send(sdk.Close(opened.id, 0))  # no handle will ever close it
            if pending is not None:
                pending[0].set()
            return
        assert handle is not None
        marking = Marking(opened.level, opened.dscp, opened.so_priority, opened.nccl_traffic_class)
        handle._set_marking(marking)
        if pending is not None:
            pending[0].set()
        elif handle._sent:
            self.send(sdk.Progress(opened.id, handle._sent))

    def _drop(self, sock: socket.socket, *, close: bool = True) -> None:
        with self._state_lock:
            sender = None
            if self._sock is sock:
                self._sock = None
                sender, self._sender = self._sender, None
            for event, _, _ in self._pending.values():
                event.set()
            self._late.clear()  # the agent closes the flows of a connection that ends
            for handle in self._live:
                handle.id = None
            self._handles.clear()
        if sender is not None:
            sender.stop()
        if close:
            with contextlib.suppress(OSError):
                sock.close()
        self._start_reconnecting()

    def close(self) -> None:
        """Close the connection for good (tests; normal processes just exit)."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            self._drop(sock)

    def _disown_after_fork(self) -> None:
        """In a forked child: let go of the parent's connection without touching it (the
        socket is shared with the parent), and never use or re-make it here."""
        self._state_lock = threading.Lock()  # another thread of the parent may have held it
        self._closed = True
        sock, self._sock, self._sender = self._sock, None, None
        self._pending.clear()
        self._late.clear()
        self._handles.clear()
        self._live.clear()
        if sock is not None:
            with contextlib.suppress(OSError):
                os.close(sock.detach())  # this process's copy of the descriptor only


class AgentUnavailable(OSError):
    """No trusted agent answers at a socket path; ``problem`` says which check failed
    (``directory``, ``absent``, ``untrusted``, ``refused``)."""

    def __init__(self, message: str, problem: str) -> None:
        super().__init__(message)
        self.problem = problem


def _connect_trusted(path: str, timeout: float) -> socket.socket:
    """A connection (with ``timeout`` set) to the agent at ``path``, checked as the SDK checks
    it: a directory no untrusted user controls, a server running as a trusted uid.

    Raises:
        AgentUnavailable: naming the path and what is wrong with it.
    """
    problem = rundir.client_dir_problem(path)
    if problem is not None:
        raise AgentUnavailable(
            f"not using the flowsched agent socket {path}: {problem}", "directory"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise AgentUnavailable(
            f"no flowsched agent at {path} ({exc.strerror or exc})", "absent"
        ) from None
    uid = _peer_uid(sock)
    if uid not in rundir.trusted_agent_uids():
        sock.close()
        raise AgentUnavailable(
            f"the process serving {path} runs as uid {uid}, not as root, this user or "
            f"${rundir.AGENT_UID_ENV}: not a flowsched agent to trust",
            "untrusted",
        )
    return sock


@dataclass(frozen=True, slots=True)
class FlowListing:
    """The agent's open SDK flows (:func:`list_flows`)."""

    #: the socket the agent answered on
    path: str
    flows: tuple[sdk.FlowInfo, ...]
    #: every user's flows are listed (the asker is root or the agent's user), not only its own
    everyone: bool


def list_flows(socket_path: str | None = None, *, timeout: float = OPEN_TIMEOUT) -> FlowListing:
    """The SDK flows open at the node agent, oldest first (what ``flowsched flows`` shows).

    Root and the agent's own user get every user's flows; another user gets its own. Uses a
    connection of its own (not the process's flows' connection), closed before it returns; the
    whole exchange takes at most ``timeout`` seconds. ``socket_path`` None: the places
    :func:`default_socket_path` would use, each tried in turn.

    Raises:
        AgentUnavailable: no trusted agent answers, it does not list flows (an older one), or
            it sent a frame that does not decode.
        TimeoutError: the agent did not answer within ``timeout``.
    """
    if socket_path is not None:
        places = [socket_path]
    else:
        places = rundir.client_paths(rundir.SOCKET_NAME, "FLOWSCHED_SOCKET")
    deadline = time.monotonic() + timeout
    failures: list[AgentUnavailable] = []
    for path in places:
        left = deadline - time.monotonic()
        if left <= 0:  # what an earlier place said beats a bare timeout
            if failures:
                raise failures[0]
            raise TimeoutError(f"no flowsched agent listed its flows within {timeout:g} s")
        try:
            sock = _connect_trusted(path, left)
        except AgentUnavailable as exc:
            failures.append(exc)
            continue
        with sock:
            flows, everyone = _ask_pages(sock, path, deadline)
        return FlowListing(path, flows, everyone)
    raise failures[0]


def _ask_pages(
    sock: socket.socket, path: str, deadline: float
) -> tuple[tuple[sdk.FlowInfo, ...], bool]:
    """Ask for ``flows`` pages until the last; the flows and whether they are everyone's."""
    decoder = sdk.SdkDecoder("client")
    flows: list[sdk.FlowInfo] = []
    after: int | None = None
    while True:
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(sdk.encode(sdk.ListFlows(after)), socket.MSG_NOSIGNAL)
            page = _next_answer(sock, decoder, path, deadline)
        except (TimeoutError, AgentUnavailable):
            raise
        except OSError as exc:  # it closed the connection first (a refused one, say)
            said = _last_word(sock, decoder)
            why = f"{said.code}: {said.reason}" if said is not None else exc.strerror or exc
            raise AgentUnavailable(
                f"the flowsched agent at {path} closed the connection ({why})", "refused"
            ) from None
        flows.extend(page.flows)
        if not page.more or not page.flows:
            return tuple(flows), page.everyone
        after = page.flows[-1].id


def _last_word(sock: socket.socket, decoder: sdk.SdkDecoder) -> sdk.Error | None:
    """The error frame an agent sent before it closed the connection, if it sent one."""
    with contextlib.suppress(OSError, sdk.SdkProtocolError):
        decoder.feed(sock.recv(65536, socket.MSG_DONTWAIT))
        while (message := decoder.next_message()) is not None:
            if isinstance(message, sdk.Error):
                return message
    return None


def _next_answer(
    sock: socket.socket, decoder: sdk.SdkDecoder, path: str, deadline: float
) -> sdk.FlowList:
    while True:
        try:
            message = decoder.next_message()
        except sdk.SdkProtocolError as exc:
            raise AgentUnavailable(
                f"the flowsched agent at {path} sent a bad frame: {exc}", "refused"
            ) from None
        if isinstance(message, sdk.FlowList):
            return message
        if isinstance(message, sdk.Error) and message.code == "bad_frame":
            # an agent of an earlier release: the type is unknown to it
            raise AgentUnavailable(
                f"the flowsched agent at {path} does not list flows ({message.code}: "
                f"{message.reason}); it may be older than this client",
                "refused",
            )
        if isinstance(message, sdk.Error):  # too_many_connections, say: what it said
            raise AgentUnavailable(
                f"the flowsched agent at {path} refused: {message.code}: {message.reason}",
                "refused",
            )
        if message is not None:
            continue  # nothing else is sent on this connection; skip it
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        data = sock.recv(65536)
        if not data:
            raise AgentUnavailable(f"the flowsched agent at {path} closed the connection",
                                   "refused")  # fmt: skip
        decoder.feed(data)


def _own_pid_namespace() -> int | None:
    """A descriptor of this process's pid namespace (None where /proc has none): shown to the
    agent, it lets an agent that may not read this process's namespace link its flows to its
    NCCL connections (flowsched.shm.pidns)."""
    try:
        return os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED), or None."""
    credentials = rundir.peer_credentials(sock)
    return None if credentials is None else credentials[1]


#: every FlowHandle alive in this process (see _after_fork_in_child)
_all_handles: weakref.WeakSet[FlowHandle] = weakref.WeakSet()
#: socket path -> its connection; None: the default path's (see AgentConnection)
_connections: dict[str | None, AgentConnection] = {}
_last_job: str | None = None
_connections_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, multiprocessing's fork) inherits its parent's
    connections but not their threads: it lets them go and makes its own, under its own pid.
    Sharing the parent's socket would route the child's answers to the parent, and keep the
    parent's flows open at the agent after the parent died."""
    global _connections, _connections_lock
    inherited = list(_connections.values())
    _connections, _connections_lock = {}, threading.Lock()
    for conn in inherited:
        conn._disown_after_fork()
    # another thread of the parent (the reader giving a handle its level, or one reporting
    # progress) may have held a handle's lock at the fork: nobody would ever release it here
    for handle in list(_all_handles):
        handle._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _byte_count(value: int, name: str) -> int:
    """``value`` as a byte count the protocol carries (0..2**64-1): an integer (numpy's too),
    or a float that holds a whole number (sizes computed in floating point).

    Raises:
        ValueError: naming ``name``: not a whole number (3.7 was cut to 3 and "12" read as
            12), NaN, an infinity, or out of range.
    """
    count = -1
    if isinstance(value, bool):  # (an int, but surely a mistake)
        pass
    elif isinstance(value, numbers.Integral):
        count = operator.index(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        count = int(value)
    if not 0 <= count <= U64_MAX:
        raise ValueError(f"{name} must be a byte count in 0..2**64-1, got {value!r}")
    return count


def connection(path: str | None = None) -> AgentConnection:
    """The shared :class:`AgentConnection` for ``path`` (default :func:`default_socket_path`,
    decided again whenever the connection is made; a ``path`` that is the default now gets
    the default's connection, kept under that name too: later calls find it without a look
    at the file system)."""
    key = path or None
    with _connections_lock:
        conn = _connections.get(key)
    if conn is not None:
        return conn
    if key is not None and key == default_socket_path():
        conn = connection(None)
    with _connections_lock:
        if conn is None:
            conn = AgentConnection(key)
        return _connections.setdefault(key, conn)


def open_flow(
    cls: FlowClass | str,
    *,
    bytes: int | None = None,
    deadline: float | None = None,
    consumer_step: int | None = None,
    request: str | None = None,
    peer: int | None = None,
    job: str | None = None,
    socket_path: str | None = None,
    dst_node: str | None = None,
) -> FlowHandle:
    """Open a flow without a ``with`` block; call :meth:`FlowHandle.close` when done.

    ``deadline`` is absolute wall-clock seconds (``time.time() + 20`` for 20 s from now: a
    small number such as ``20.0``, a time in 1970, is refused); ``consumer_step`` is the job
    step (RLI) that consumes the data, of ``job`` (default: the job last passed to
    :func:`job_progress` in this process); ``peer`` narrows NCCL linking to one peer rank
    (-1, like None, narrows nothing); ``dst_node`` names the node that receives the data (the
    agent then counts that node's ingress link, ``<dst_node>:rx``, among the flow's links, so
    the coordinator sees incast at the receiver). Argument errors raise ValueError; an absent
    or failing agent never raises.
    """
    flow_class = FlowClass.parse(cls) if isinstance(cls, str) else FlowClass(cls)
    bytes, deadline, consumer_step, peer = map(_plain, (bytes, deadline, consumer_step, peer))
    request_template = sdk.Open(
        0, flow_class.label, bytes, deadline, consumer_step, job, request, peer, dst_node
    )
    _check_open(request_template)
    if job is None and consumer_step is not None:
        job = _last_job  # the job this process last reported with job_progress()
    conn = connection(socket_path)
    handle = FlowHandle(flow_class, conn)
    try:
        handle._request = dataclasses.replace(request_template, job=job)
        if conn.ensure_connected():
            req = dataclasses.replace(handle._request, ref=conn.next_ref())
            conn.open(req, handle)  # sets the handle's id and marking when answered
        conn.track(handle)
    except Exception:  # never into the application
        log.exception("flowsched: opening the flow at the agent failed; using static defaults")
    return handle


def _plain(value: Any) -> Any:
    """A number of another type (numpy's ``int64``, ``float32``) as the int or float it holds:
    the protocol's checks and its encoder take only those (numpy's scalars failed in them
    with a ValueError about arrays). Anything else, a bool included, is left to the checks."""
    if type(value) in (int, float, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return operator.index(value)
    return float(value)


#: open_flow() arguments whose names differ from the ``open`` message's fields
_ARGUMENT_NAMES = {"size": "bytes", "consumer_index": "consumer_step"}


def _check_open(request: sdk.Open) -> None:
    """Refuse what the agent's SDK decoder would refuse (it would drop the whole connection)."""
    try:
        sdk.check_message(request)
    except sdk.SdkProtocolError as exc:
        field = exc.field or "open"
        name = _ARGUMENT_NAMES.get(field, field)
        value = getattr(request, field, None)
        reason = str(exc).split(": ", 1)[-1]
        raise ValueError(f"{name} is invalid ({reason}), got {value!r}") from None


@contextlib.contextmanager
def flow(
    cls: FlowClass | str,
    *,
    bytes: int | None = None,
    deadline: float | None = None,
    consumer_step: int | None = None,
    request: str | None = None,
    peer: int | None = None,
    job: str | None = None,
    socket_path: str | None = None,
    dst_node: str | None = None,
) -> Iterator[FlowHandle]:
    """Context manager around :func:`open_flow`: the flow is closed when the block exits."""
    handle = open_flow(
        cls,
        bytes=bytes,
        deadline=deadline,
        consumer_step=consumer_step,
        request=request,
        peer=peer,
        job=job,
        socket_path=socket_path,
        dst_node=dst_node,
    )
    try:
        yield handle
    finally:
        handle.close()


def job_progress(
    job: str,
    step: int,
    layer: int | None = None,
    *,
    done: bool = False,
    socket_path: str | None = None,
) -> bool:
    """Tell the agent that ``job`` reached ``step`` (and ``layer``); False if no agent got it.

    ``done=True`` says the job ended (a serving batch whose prefill finished): the agent and
    the coordinator forget it at once, so rmlq stops holding its KV transfers below its
    collectives (docs/rmlq.md). Needs an agent of this release (an earlier one refuses it).
    """
    step, layer = _plain(step), _plain(layer)
    try:
        sdk.check_message(sdk.JobProgress(job, step, layer))
    except sdk.SdkProtocolError as exc:
        raise ValueError(
            f"job must be a printable name, step an integer in 0..{sdk.MAX_STEP} and layer in "
            f"0..{sdk.MAX_LAYER}, "
            f"got {job!r}, {step!r}, {layer!r} ({exc})"
        ) from None
    global _last_job
    _last_job = job
    conn = connection(socket_path)
    try:
        return conn.report_job(sdk.JobProgress(job, step, layer, True if done else None))
    except Exception:
        log.exception("flowsched: job_progress failed")
        return False
