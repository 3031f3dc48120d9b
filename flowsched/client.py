"""Application SDK: tell the node agent what NCCL cannot, and learn the marking to use.

>>> from flowsched import client
>>> with client.flow("param_sync", bytes=14 << 30, deadline=time.time() + 30) as f:
...     sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, f.tos)   # or flowsched.transfer
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
first appears; a flow is closed at the agent when its process disconnects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from flowsched import rundir
from flowsched.model import FlowClass
from flowsched.protocol import sdk

log = logging.getLogger("flowsched.client")

OPEN_TIMEOUT = 2.0
RECONNECT_INTERVAL = 1.0


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

    Cached: parsing the policy file takes a few ms with the GIL held, on every flow open.
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

    def __init__(self, cls: FlowClass, marking: Marking, conn: AgentConnection | None) -> None:
        self.cls = cls
        self.id: int | None = None
        self._marking = marking
        self._conn = conn
        self._sent = 0
        self._closed = False
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._request: sdk.Open | None = None  # to re-open the flow at a restarted agent

    # ------------------------------------------------------------ marking
    @property
    def connected(self) -> bool:
        """True when the agent acknowledged the flow (False: static default marking)."""
        return self.id is not None

    @property
    def marking(self) -> Marking:
        """The current level and marking."""
        return self._marking

    @property
    def level(self) -> int:
        """Current level (0 = most urgent)."""
        return self._marking.level

    @property
    def dscp(self) -> int:
        """DSCP code point (0..63) to put on this flow's packets now."""
        return self._marking.dscp

    @property
    def tos(self) -> int:
        """IP TOS / IPv6 traffic class / RoCE GRH traffic class byte: DSCP << 2."""
        return self._marking.dscp << 2

    @property
    def so_priority(self) -> int:
        """SO_PRIORITY to set (after IP_TOS, which overwrites it on Linux)."""
        return self._marking.so_priority

    @property
    def nccl_traffic_class(self) -> int | None:
        """The NCCL trafficClass the policy maps to this flow's class, if any."""
        return self._marking.nccl_traffic_class

    @property
    def decided_ns(self) -> int | None:
        """CLOCK_MONOTONIC ns at which the coordinator decided the current level (None when
        unknown). Comparable only with monotonic times of the coordinator's machine."""
        return self._marking.decided_ns

    @property
    def decided_at(self) -> float | None:
        """Wall-clock seconds at which the coordinator decided the current level, or None."""
        return self._marking.decided_at

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
            changed = marking != self._marking
            self._marking = marking
            listeners = list(self._listeners)
        if changed:
            for callback in listeners:
                try:
                    callback(self)
                except Exception:
                    log.exception("flowsched listener failed")

    # ------------------------------------------------------------ progress
    def progress(self, sent: int) -> None:
        """Report that ``sent`` bytes of this flow have been sent so far (absolute count)."""
        with self._lock:
            self._sent = max(self._sent, int(sent))
        if self._conn is not None and self.id is not None:
            self._conn.send(sdk.Progress(self.id, self._sent))

    def add_bytes(self, nbytes: int) -> None:
        """Report ``nbytes`` more bytes sent."""
        self.progress(self._sent + int(nbytes))

    def close(self) -> None:
        """Close the flow at the agent (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._conn is not None:
            if self.id is not None:
                self._conn.send(sdk.Close(self.id, self._sent))
            self._conn.forget(self)


class AgentConnection:
    """The process's connection to its node agent (one per socket path; thread-safe)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._refs = itertools.count(1)
        #: open requests waiting for their answer: ref -> (answered, answer, handle)
        self._pending: dict[int, tuple[threading.Event, list[sdk.SdkMessage], FlowHandle]] = {}
        self._handles: dict[int, FlowHandle] = {}
        self._live: set[FlowHandle] = set()
        self._last_attempt = -RECONNECT_INTERVAL
        self._warned = False
        self._closed = False
        self._reconnecting = False
        self._refusal: str | None = None

    def ensure_connected(self) -> bool:
        """Connect if not connected (at most once per RECONNECT_INTERVAL); True if connected."""
        with self._state_lock:
            if self._sock is not None:
                return True
            now = time.monotonic()
            if now - self._last_attempt < RECONNECT_INTERVAL:
                return False
            self._last_attempt = now
            problem = rundir.client_dir_problem(self.path)
            if problem is not None:
                self._warn(f"not using the flowsched agent socket {self.path}: {problem}; "
                           "using static default levels")  # fmt: skip
                return False
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(OPEN_TIMEOUT)
                sock.connect(self.path)
                sock.settimeout(None)
            except OSError as exc:
                self._warn(
                    f"no flowsched agent at {self.path} ({exc.strerror or exc}); "
                    "using static default levels"
                )
                return False
            uid = _peer_uid(sock)
            if uid not in rundir.trusted_agent_uids():
                sock.close()
                self._warn(
                    f"the process serving {self.path} runs as uid {uid}, not as root, this user "
                    f"or ${rundir.AGENT_UID_ENV}: not a flowsched agent to trust; using static "
                    "default levels"
                )
                return False
            self._sock = sock
        threading.Thread(
            target=self._reader, args=(sock,), name="flowsched-sdk", daemon=True
        ).start()
        return True

    def _warn(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", text)

    def send(self, message: sdk.SdkMessage) -> bool:
        """Send one message; False (and the connection dropped) on failure."""
        sock = self._sock
        if sock is None:
            return False
        try:
            with self._send_lock:
                sock.sendall(sdk.encode(message))
        except OSError:
            # the agent closed it: the reader thread closes the socket once it has read what
            # the agent said last (a refusal, logged there)
            self._drop(sock, close=False)
            return False
        return True

    def open(self, request: sdk.Open, handle: FlowHandle) -> sdk.Opened | None:
        """Send ``open`` and wait for ``opened``; None on error or timeout.

        The reader thread gives ``handle`` its id and marking the moment ``opened`` arrives,
        before it reads the next frame: a ``level`` the agent pushes right after ``opened``
        is never lost, nor overwritten by the older marking ``opened`` carried.
        """
        event = threading.Event()
        box: list[sdk.SdkMessage] = []
        with self._state_lock:
            self._pending[request.ref] = (event, box, handle)
        try:
            if not self.send(request) or not event.wait(OPEN_TIMEOUT) or not box:
                return None
        finally:
            with self._state_lock:
                self._pending.pop(request.ref, None)
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
            self._live.add(handle)
            start = self._sock is None
        if start:
            self._start_reconnecting()

    def forget(self, handle: FlowHandle) -> None:
        """The flow is closed: stop routing level pushes to it and stop re-opening it."""
        with self._state_lock:
            self._live.discard(handle)
            if handle.id is not None:
                self._handles.pop(handle.id, None)

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

    def _reopen(self, handle: FlowHandle) -> None:
        if handle._request is None:
            return
        request = dataclasses.replace(handle._request, ref=self.next_ref())
        reply = self.open(request, handle)
        if reply is None:
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
            with self._state_lock:
                pending = self._pending.get(ref)
                if pending is not None and isinstance(message, sdk.Opened):
                    pending[2].id = message.id
                    self._handles[message.id] = pending[2]
            if pending is not None:
                if isinstance(message, sdk.Opened):
                    pending[2]._set_marking(
                        Marking(message.level, message.dscp, message.so_priority,
                                message.nccl_traffic_class)
                    )  # fmt: skip
                pending[1].append(message)
                pending[0].set()
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

    def _drop(self, sock: socket.socket, *, close: bool = True) -> None:
        with self._state_lock:
            if self._sock is sock:
                self._sock = None
            for event, _, _ in self._pending.values():
                event.set()
            for handle in self._live:
                handle.id = None
            self._handles.clear()
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


def _peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED), or None."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", raw)[1])


_connections: dict[str, AgentConnection] = {}
_last_job: str | None = None
_connections_lock = threading.Lock()


def connection(path: str | None = None) -> AgentConnection:
    """The shared :class:`AgentConnection` for ``path`` (default :func:`default_socket_path`)."""
    path = path or default_socket_path()
    with _connections_lock:
        conn = _connections.get(path)
        if conn is None:
            conn = _connections[path] = AgentConnection(path)
        return conn


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

    ``deadline`` is absolute wall-clock seconds (``time.time()``); ``consumer_step`` is the job
    step (RLI) that consumes the data, of ``job`` (default: the job last passed to
    :func:`job_progress` in this process); ``peer`` narrows NCCL linking to one peer rank;
    ``dst_node`` names the node that receives the data (the agent then counts that node's
    ingress link, ``<dst_node>:rx``, among the flow's links, so the coordinator sees incast at
    the receiver). Argument errors raise ValueError; an absent or failing agent never raises.
    """
    flow_class = FlowClass.parse(cls) if isinstance(cls, str) else FlowClass(cls)
    request_template = sdk.Open(
        0, flow_class.label, bytes, deadline, consumer_step, job, request, peer, dst_node
    )
    _check_open(request_template)
    if job is None and consumer_step is not None:
        job = _last_job  # the job this process last reported with job_progress()
    conn = connection(socket_path)
    handle = FlowHandle(flow_class, static_marking(flow_class), conn)
    try:
        handle._request = dataclasses.replace(request_template, job=job)
        if conn.ensure_connected():
            req = dataclasses.replace(handle._request, ref=conn.next_ref())
            conn.open(req, handle)  # sets the handle's id and marking when answered
        conn.track(handle)
    except Exception:  # never into the application
        log.exception("flowsched: opening the flow at the agent failed; using static defaults")
    return handle


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
    job: str, step: int, layer: int | None = None, *, socket_path: str | None = None
) -> bool:
    """Tell the agent that ``job`` reached ``step`` (and ``layer``); False if no agent got it."""
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
        return conn.ensure_connected() and conn.send(sdk.JobProgress(job, step, layer))
    except Exception:
        log.exception("flowsched: job_progress failed")
        return False
