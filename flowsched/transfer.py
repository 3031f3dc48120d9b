"""A small TCP sender/receiver for transfers outside NCCL (KV cache, experience, weights).

The sender marks its socket with the flow's current level (DSCP through ``IP_TOS`` /
``IPV6_TCLASS``, then ``SO_PRIORITY``, in that order because Linux resets SO_PRIORITY when
IP_TOS is set) and follows promotions while it sends. A promotion only reaches packets built
after it, and a starved socket may hold a large backlog in a low-priority queue, so the sender
keeps little unsent data below it: it writes bounded chunks on a non-blocking socket and waits
for writability with ``TCP_NOTSENT_LOWAT`` set, and a marking change is applied from the
thread that reports it (the SDK's reader thread), never waiting for a blocked ``send``.

Wire format of one transfer: a 24-byte header (``b"FSX1"``, u32 reserved, u64 size, u64 flow
id), ``size`` payload bytes, then the payload's SHA-256 (32 bytes). The receiver verifies the
digest and answers one status byte (1 = intact), which is when the sender's transfer ends.

>>> rx = Receiver(("127.0.0.1", 0)); rx.start()
>>> stats = send_flow(rx.address, 10 << 20, flow_handle=handle)
>>> rx.results.get(timeout=5).ok
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import numbers
import operator
import queue
import random
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from flowsched.lograte import RepeatLog

log = logging.getLogger("flowsched.transfer")

HEADER = struct.Struct("!4sIQQ")
MAGIC = b"FSX1"
DIGEST_SIZE = 32
DEFAULT_CHUNK = 64 * 1024
DEFAULT_NOTSENT_LOWAT = 128 * 1024
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
_IPV6_TCLASS = getattr(socket, "IPV6_TCLASS", 67)
_PATTERN_BLOCK = 1 << 20
#: transfers a :class:`Receiver` serves at once (a thread and a 256 KiB buffer each); it
#: closes a connection beyond at once, and the sender gets a TransferError
RECEIVER_MAX_CONNECTIONS = 256
#: seconds a :class:`Receiver` waits after a failed accept (out of descriptors, say) before it
#: tries again; the sender waits in the listen backlog meanwhile
ACCEPT_RETRY_DELAY = 0.2


class MarkedFlow(Protocol):
    """What the sender needs from a flow handle (a :class:`flowsched.client.FlowHandle`)."""

    @property
    def level(self) -> int: ...
    @property
    def dscp(self) -> int: ...
    @property
    def so_priority(self) -> int: ...
    @property
    def id(self) -> int | None: ...
    def add_listener(self, callback: Callable[[MarkedFlow], None]) -> None: ...
    def remove_listener(self, callback: Callable[[MarkedFlow], None]) -> None: ...
    def progress(self, sent: int) -> None: ...


class TransferError(Exception):
    """The transfer failed (connection lost, timeout, or the receiver saw corrupt data)."""


@dataclass(slots=True)
class SendStats:
    """What one :func:`send_flow` call did."""

    bytes: int
    started: float
    finished: float
    digest: str
    #: (time.monotonic(), level) each time a marking was applied to the socket
    levels: list[tuple[float, int]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """Duration from connect to the receiver's acknowledgement."""
        return self.finished - self.started


@dataclass(slots=True)
class ReceiveStats:
    """What the receiver saw for one transfer."""

    flow_id: int
    bytes: int
    expected: int
    ok: bool
    digest: str
    started: float
    first_byte: float
    completed: float
    completed_wall: float
    peer: str
    error: str | None = None


# ------------------------------------------------------------------------- marking
class SocketMarker:
    """Applies a level's marking to a socket; thread-safe; EPERM on SO_PRIORITY is logged once."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._warned = False
        self._stopped = False
        self.applied: list[tuple[float, int]] = []

    def apply(self, level: int, dscp: int, so_priority: int) -> None:
        """Set IP_TOS / IPV6_TCLASS to ``dscp << 2``, then SO_PRIORITY (nothing once
        :meth:`stop` was called)."""
        tos = (dscp & 0x3F) << 2
        with self._lock:
            if self._stopped:
                return
            try:
                if self._sock.family == socket.AF_INET6:
                    self._sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_TCLASS, tos)
                    # an IPv4 peer (v4-mapped: a socket accepted on a dual-stack listener)
                    # gets IPv4 packets, whose TOS comes from IP_TOS, not IPV6_TCLASS
                    with contextlib.suppress(OSError):
                        self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
                else:
                    self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
                self._set_priority(so_priority)
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    log.warning("cannot mark socket: %s", exc)
                return
            self.applied.append((time.monotonic(), level))

    def stop(self) -> None:
        """Mark the socket no more, whoever calls :meth:`apply` later: a flow handle's reader
        thread may still run a listener it copied before :meth:`follow`'s was removed, and the
        socket may carry another flow by then. An :meth:`apply` under way ends first."""
        with self._lock:
            self._stopped = True

    def _set_priority(self, so_priority: int) -> None:
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, so_priority)
        except PermissionError:
            if not self._warned:
                self._warned = True
                log.warning("SO_PRIORITY %d needs CAP_NET_ADMIN; relying on DSCP", so_priority)

    def follow(self, handle: MarkedFlow) -> Callable[[MarkedFlow], None]:
        """Apply ``handle``'s marking now and on each change; returns the listener to remove."""

        def on_change(h: MarkedFlow) -> None:
            self.apply(h.level, h.dscp, h.so_priority)

        handle.add_listener(on_change)
        on_change(handle)
        return on_change


# ------------------------------------------------------------------------- payload
def pattern(size: int, seed: int = 0) -> Iterator[bytes]:
    """Deterministic pseudo-random payload of ``size`` bytes, in blocks of up to 1 MiB."""
    doubled = _pattern_base(seed)
    offset, block = 0, 0
    while offset < size:
        shift = (block * 4099) % _PATTERN_BLOCK  # block i is the base rotated left by shift
        take = min(size - offset, _PATTERN_BLOCK)
        yield doubled[shift : shift + take]
        offset += take
        block += 1


@functools.lru_cache(maxsize=4)
def _pattern_base(seed: int) -> bytes:
    """The seed's random block, twice over, so that any rotation of it is one slice.

    Cached: drawing 1 MiB from ``random`` takes ~9 ms with the GIL held, which every other
    thread of a sending process (other flows, the SDK's link to its agent) would wait out
    at the start of each transfer.
    """
    base = random.Random(seed).randbytes(_PATTERN_BLOCK)
    return base + base


def pattern_digest(size: int, seed: int = 0) -> str:
    """SHA-256 hex digest of :func:`pattern` ``(size, seed)``."""
    h = hashlib.sha256()
    for piece in pattern(size, seed):
        h.update(piece)
    return h.hexdigest()


def _blocks(
    data: bytes | memoryview | int, seed: int, block: int = _PATTERN_BLOCK
) -> tuple[int, Iterator[bytes | memoryview]]:
    """The payload's size and its blocks: a user buffer in zero-copy slices of at most
    ``block`` bytes, so that hashing, sending and progress reports interleave."""
    # numpy's integers too, which are buffers as well (of their own 4 or 8 bytes)
    if isinstance(data, int | numbers.Integral):
        size = operator.index(data)
        return size, iter(pattern(size, seed))
    view = memoryview(data).cast("B")
    block = max(block, 1)
    return len(view), (view[i : i + block] for i in range(0, len(view), block))


# ------------------------------------------------------------------------- sender
def send_flow(
    sock_or_addr: socket.socket | tuple[str, int],
    data_or_size: bytes | memoryview | int,
    *,
    flow_handle: MarkedFlow | None = None,
    chunk: int = DEFAULT_CHUNK,
    notsent_lowat: int = DEFAULT_NOTSENT_LOWAT,
    timeout: float = 60.0,
    seed: int = 0,
    flow_id: int | None = None,
    report_every: int = 1 << 20,
) -> SendStats:
    """Send ``data_or_size`` (bytes, or a size for a :func:`pattern` payload) as one transfer.

    ``sock_or_addr`` is a connected TCP socket (left open) or an address to connect to (closed
    afterwards; its timeout and blocking mode are restored, its marking and
    TCP_NOTSENT_LOWAT stay). With ``flow_handle`` the socket follows the flow's marking and
    the flow's progress is reported every ``report_every`` bytes. Raises
    :class:`TransferError` when the receiver does not acknowledge an intact transfer within
    ``timeout`` of inactivity.
    """
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    if isinstance(sock_or_addr, socket.socket):
        sock, owned = sock_or_addr, False
    else:
        sock, owned = _connect(sock_or_addr, timeout), True
    marker = SocketMarker(sock)
    listener = marker.follow(flow_handle) if flow_handle is not None else None
    started = time.monotonic()
    caller_timeout = sock.gettimeout()
    try:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, notsent_lowat)
        size, blocks = _blocks(data_or_size, seed, min(report_every, _PATTERN_BLOCK))
        fid = flow_id if flow_id is not None else (flow_handle.id if flow_handle else None) or 0
        digest = _stream(
            sock,
            HEADER.pack(MAGIC, 0, size, fid),
            blocks,
            chunk,
            timeout,
            flow_handle,
            report_every,
        )
        _await_ack(sock, timeout)
    finally:
        if listener is not None and flow_handle is not None:
            flow_handle.remove_listener(listener)
        marker.stop()  # a listener call already copied by the handle's thread changes nothing
        if owned:
            sock.close()
        else:
            with contextlib.suppress(OSError):
                sock.settimeout(caller_timeout)
    return SendStats(size, started, time.monotonic(), digest, marker.applied)


def send_with_flow(
    sock_or_addr: socket.socket | tuple[str, int],
    data_or_size: bytes | memoryview | int,
    cls: str,
    *,
    deadline: float | None = None,
    consumer_step: int | None = None,
    request: str | None = None,
    job: str | None = None,
    dst_node: str | None = None,
    socket_path: str | None = None,
    **send_options: Any,
) -> SendStats:
    """Open an SDK flow for this transfer (:func:`flowsched.client.flow`) and send it with
    :func:`send_flow`, following the flow's level.

    ``dst_node`` names the receiving node; the agent then counts that node's ingress link
    (``<dst_node>:rx``) among the flow's links. ``send_options`` go to :func:`send_flow`.
    """
    from flowsched import client

    size, _ = _blocks(data_or_size, 0)  # the size only: the blocks are made when iterated
    with client.flow(
        cls,
        bytes=size,
        deadline=deadline,
        consumer_step=consumer_step,
        request=request,
        job=job,
        dst_node=dst_node,
        socket_path=socket_path,
    ) as handle:
        return send_flow(sock_or_addr, data_or_size, flow_handle=handle, **send_options)


def _connect(addr: tuple[str, int], timeout: float) -> socket.socket:
    try:
        return socket.create_connection(addr, timeout=timeout)
    except OSError as exc:
        raise TransferError(f"cannot connect to {addr}: {exc}") from exc


def _stream(
    sock: socket.socket,
    header: bytes,
    blocks: Iterator[bytes | memoryview],
    chunk: int,
    timeout: float,
    handle: MarkedFlow | None,
    report_every: int,
) -> str:
    digest = hashlib.sha256()
    sock.setblocking(False)
    sent_payload, next_report = 0, report_every
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_WRITE)
        _write_all(sock, sel, memoryview(header), chunk, timeout)
        for block in blocks:
            digest.update(block)
            _write_all(sock, sel, memoryview(block).cast("B"), chunk, timeout)
            sent_payload += len(block)
            if handle is not None and sent_payload >= next_report:
                handle.progress(sent_payload)
                next_report = sent_payload + report_every
        _write_all(sock, sel, memoryview(digest.digest()), chunk, timeout)
    if handle is not None:
        handle.progress(sent_payload)
    sock.setblocking(True)
    return digest.hexdigest()


def _write_all(
    sock: socket.socket, sel: selectors.BaseSelector, view: memoryview, chunk: int, timeout: float
) -> None:
    offset = 0
    while offset < len(view):
        if not sel.select(timeout):
            raise TransferError(f"send stalled for {timeout} s")
        try:
            # MSG_NOSIGNAL: a receiver gone is a TransferError, even where the application
            # left SIGPIPE at its default (which would end the whole process)
            offset += sock.send(view[offset : offset + chunk], socket.MSG_NOSIGNAL)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise TransferError(f"send failed after {offset} bytes of a block: {exc}") from exc


def _await_ack(sock: socket.socket, timeout: float) -> None:
    sock.settimeout(timeout)
    try:
        status = sock.recv(1)
    except OSError as exc:
        raise TransferError(f"no acknowledgement from the receiver: {exc}") from exc
    if not status:
        raise TransferError("the receiver closed the connection without acknowledging the transfer")
    if status != b"\x01":
        raise TransferError("the receiver reported a corrupt or incomplete transfer")


# ------------------------------------------------------------------------- receiver
def receive_flow(sock: socket.socket, *, timeout: float = 60.0) -> ReceiveStats:
    """Receive one transfer on a connected socket, verify it, acknowledge it, return stats."""
    started = time.monotonic()
    sock.settimeout(timeout)
    stats = ReceiveStats(0, 0, 0, False, "", started, 0.0, 0.0, 0.0, _peer_name(sock))
    try:
        magic, _, stats.expected, stats.flow_id = HEADER.unpack(recv_exact(sock, HEADER.size))
        if magic != MAGIC:
            return _finish(stats, f"bad magic {magic!r}")
        digest = _read_body(sock, stats)
        trailer = recv_exact(sock, DIGEST_SIZE) if stats.bytes == stats.expected else b""
    except (OSError, TransferError, struct.error) as exc:
        return _finish(stats, f"connection lost after {stats.bytes} bytes: {exc}")
    stats.digest = digest.hexdigest()
    stats.ok = stats.bytes == stats.expected and trailer == digest.digest()
    with contextlib.suppress(OSError):
        sock.sendall(b"\x01" if stats.ok else b"\x00", socket.MSG_NOSIGNAL)
    if not stats.ok:
        what = "digest mismatch" if trailer else "incomplete"
        return _finish(stats, f"received {stats.bytes}/{stats.expected} bytes, {what}")
    return _finish(stats, None)


def _read_body(sock: socket.socket, stats: ReceiveStats) -> Any:
    digest = hashlib.sha256()
    buf = bytearray(256 * 1024)
    while stats.bytes < stats.expected:
        n = sock.recv_into(buf, min(len(buf), stats.expected - stats.bytes))
        if n == 0:
            break
        stats.first_byte = stats.first_byte or time.monotonic()
        digest.update(memoryview(buf)[:n])
        stats.bytes += n
    return digest


def _finish(stats: ReceiveStats, error: str | None) -> ReceiveStats:
    stats.completed, stats.completed_wall = time.monotonic(), time.time()
    stats.first_byte = stats.first_byte or stats.completed
    stats.error = error
    return stats


def _peer_name(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername())
    except OSError:
        return "?"


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``; :class:`TransferError` if the peer closes first."""
    out = bytearray()
    while len(out) < n:
        piece = sock.recv(n - len(out))
        if not piece:
            raise TransferError(f"connection closed with {n - len(out)} bytes missing")
        out += piece
    return bytes(out)


class Receiver:
    """Accepts transfers on ``address`` in a background thread; each result goes to ``results``.

    One thread per connection, ``max_connections`` at once (a connection beyond is closed at
    once); ``results`` is a queue of :class:`ReceiveStats`. A failed accept (the process out
    of descriptors) is logged at a falling rate and retried: the port keeps serving once
    descriptors are free again. The receiver authenticates nobody: anyone who can reach the
    port can send it transfers, or hold its connections with a byte every ``timeout``
    seconds. Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        address: tuple[str, int] = ("127.0.0.1", 0),
        *,
        timeout: float = 60.0,
        max_connections: int = RECEIVER_MAX_CONNECTIONS,
    ) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(address)
            self._listener.listen(64)
            self._listener.settimeout(0.2)
        except BaseException:  # address in use, no such address: no socket left open
            self._listener.close()
            raise
        self._timeout = timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._repeat_log = RepeatLog(log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="flowsched-rx", daemon=True)
        self.results: queue.Queue[ReceiveStats] = queue.Queue()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port)."""
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> Receiver:
        """Start accepting."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting and close the listening socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        self._listener.close()

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # the listener is closed
                # out of descriptors or memory: ending this thread would leave the port dead
                # for every later sender; this one waits in the backlog meanwhile
                self._repeat_log.log(
                    "accept", logging.WARNING, "transfer receiver on %s cannot accept: %s",
                    self.address, exc,
                )  # fmt: skip
                self._stop.wait(ACCEPT_RETRY_DELAY)
                continue
            self._serve_in_thread(conn)

    def _serve_in_thread(self, conn: socket.socket) -> None:
        """Serve ``conn`` in a thread of its own, or close it at the connection cap."""
        if not self._slots.acquire(blocking=False):
            self._repeat_log.log(
                "cap", logging.WARNING,
                "transfer receiver on %s serves %d connections, its most: closing one from %s",
                self.address, self._max_connections, _peer_name(conn),
            )  # fmt: skip
            conn.close()
            return
        try:
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: the sender is told by the close
            self._slots.release()
            conn.close()
            self._repeat_log.log("thread", logging.WARNING, "transfer receiver: %s", exc)

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self.results.put(receive_flow(conn, timeout=self._timeout))
        finally:
            self._slots.release()
