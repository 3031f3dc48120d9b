"""One agent connection: the only code that touches a client's transport.

It feeds received bytes to the sans-IO :class:`~flowsched.protocol.Connection`, hands decoded
messages to the coordinator, and turns every failure into a close with a logged reason:
protocol errors (answered with an ``error`` frame first), timeouts, the connection errors
listed in :data:`CONNECTION_ERRORS`, and any other exception (a bug: logged with its traceback,
counted as ``internal``). A failure never propagates beyond this connection.

How the socket goes: a peer that does not read (``send_overflow``), went silent (``timeout``),
was replaced, evicted or lost has its transport aborted at once (:data:`ABORT_CODES`), queued
bytes and all, so that it holds no descriptor or buffer; any other close flushes what is
queued (the ``error`` frame saying why) for at most :data:`CLOSE_TIMEOUT` seconds, then aborts.
Text a peer sent (its ``error`` frame) is logged quoted and truncated (:func:`quoted`).

The handshake reads through a bounded StreamReader (an unauthenticated peer's bytes stay in
the kernel). Once the agent authenticated, the transport's receive callback feeds the
connection directly and the coordinator handles each frame there: no task wake-up, reader
copy or timeout context per read. Idleness is then watched by one timer per connection
(:meth:`AgentConnection._watch_idle`), rescheduled only when it fires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, SupportsIndex, cast

from flowsched import tls
from flowsched.lograte import PEER_TEXT_LIMIT, quoted
from flowsched.protocol import (
    HANDSHAKE_MAX_FRAME_SIZE,
    NEED_DATA,
    PEER_CLOSED,
    Connection,
    Error,
    Event,
    Hello,
    Message,
    RemoteProtocolError,
    Role,
    Sentinel,
    State,
    Welcome,
)

if TYPE_CHECKING:
    from flowsched.coordinator.service import Coordinator

log = logging.getLogger("flowsched.coordinator")

#: OS-level failures of a client socket; each one ends that connection only.
CONNECTION_ERRORS = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError, OSError)
READ_SIZE = 1 << 14
#: after a read timeout, how long to let the loop poll again before declaring the agent idle
IDLE_RECHECK = 0.05
#: bytes taken from the socket per receive before the peer authenticated: a whole handshake
#: frame, so that a flood of peers sending big first frames leaves their bytes in the kernel
HANDSHAKE_CHUNK = HANDSHAKE_MAX_FRAME_SIZE + 4
#: bytes per receive once authenticated (the StreamReader pauses the socket at twice this)
ESTABLISHED_CHUNK = 4 * READ_SIZE
#: bytes a TLS peer may send before the coordinator starts its handshake (a TLS hello is one
#: record of at most 16 KiB plus its header; a peer that splits it over more records pays
#: their headers out of the margin)
TLS_EARLY_LIMIT = (16 << 10) + 512
#: encrypted bytes the TLS layer may hold for a connection before it authenticates (asyncio's
#: default is 256 KiB per connection: a flood's cost, not an agent's need)
TLS_PREAUTH_READ_LIMIT = 16 << 10
#: seconds a graceful close may wait for the peer to take the queued bytes before it aborts
CLOSE_TIMEOUT = 1.0
#: close reasons whose connection is aborted at once (see the module docstring)
ABORT_CODES = frozenset({"send_overflow", "timeout", "replaced", "evicted", "connection_lost"})


class TimedStreamReader(asyncio.StreamReader):
    """A StreamReader that remembers when bytes last arrived (``time.perf_counter()``).

    That instant, taken when the event loop hands the bytes over, is also the arrival time of
    the frames they carry for the decision-latency metric: it includes any wait for the loop.
    """

    last_data = 0.0
    #: the peer closed its side (its FIN arrived), whether or not the bytes before it were read
    eof_seen = False
    #: bytes the transport may receive into the buffer at once (see BoundedReaderProtocol)
    chunk = HANDSHAKE_CHUNK

    def authenticated(self) -> None:
        """The peer authenticated: receive in large chunks and buffer up to the usual limit."""
        self.chunk = ESTABLISHED_CHUNK
        self._limit = 2 * READ_SIZE  # type: ignore[attr-defined]  # StreamReader's own limit

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        self.last_data = time.perf_counter()
        super().feed_data(data)

    def feed_eof(self) -> None:
        self.eof_seen = True
        super().feed_eof()

    def take_buffered(self) -> bytes:
        """Empty the buffer and return what it held (the reader is not read from again)."""
        buffer: bytearray = self._buffer  # type: ignore[attr-defined]  # StreamReader's own
        data = bytes(buffer)
        buffer.clear()
        self._maybe_resume_transport()  # type: ignore[attr-defined]  # it may have paused
        return data


class BoundedReaderProtocol(asyncio.BufferedProtocol):
    """Serves a StreamReaderProtocol, but the transport receives into a ``reader.chunk`` buffer.

    A plain protocol gets whatever the socket holds (up to 256 KiB per receive with uvloop)
    before anyone looks at it: 1,500 peers each sending the start of a 1 MiB first frame then
    cost 64 KiB or more of memory each at once. Receiving at most one handshake frame per call
    (the reader pauses the socket at twice that) leaves an unauthenticated peer's bytes in the
    kernel. This wraps rather than subclasses StreamReaderProtocol: uvloop treats any
    ``asyncio.Protocol`` as unbuffered. ``shared`` is one buffer for every connection of a
    loop: the transport calls ``get_buffer`` and ``buffer_updated`` back to back for one
    connection at a time. Once ``sink`` is set (the peer authenticated), received bytes and
    the end of the stream go to it instead of the reader.
    """

    #: called with each received chunk (a view of the shared buffer, valid during the call)
    sink: Callable[[memoryview], None] | None = None
    #: called once when the stream ends: None for the peer's EOF, else the transport's error
    sink_closed: Callable[[Exception | None], None] | None = None
    #: the loop time by which the peer must have authenticated, set when the TLS handshake
    #: starts the clock at the connection's accept; None: from when the connection is served
    handshake_deadline: float | None = None

    def __init__(
        self,
        reader: TimedStreamReader,
        client_connected_cb: Callable[[asyncio.StreamReader, asyncio.StreamWriter], None],
        shared: bytearray,
        start_tls: Callable[[BoundedReaderProtocol, asyncio.Transport], None] | None = None,
    ) -> None:
        self._inner = asyncio.StreamReaderProtocol(reader, client_connected_cb)
        self.reader = reader
        self._shared = shared
        self._view = memoryview(shared)[: reader.chunk]  # what get_buffer hands out
        self._start_tls = start_tls
        self._made = False  # whether the reader's protocol has its transport
        self._raw: asyncio.Transport | None = None  # the plain transport under TLS
        #: bytes received before the TLS handshake took the connection over (see above)
        self.early = bytearray()
        self._tls_started = False
        self._decrypted = bytearray()  # the peer's first frames, decrypted before secured()
        #: the connection ended before the TLS handshake took it over
        self.lost_early = False
        #: done once ``early`` holds the peer's whole client hello (however many TLS records
        #: carry it), or the peer stopped sending or closed: the handshake may start (TLS only)
        self.hello_ready: asyncio.Future[None] | None = None
        self._hello = ClientHelloWatch()

    def take_early(self) -> tuple[bytes, bytes]:
        """Empty ``early``: the records that carry the client hello (all of them, when no
        hello began there), and the bytes that came after them."""
        end = self._hello.records_end if self._hello.hello_seen else len(self.early)
        hello, after = bytes(self.early[:end]), bytes(self.early[end:])
        self.early.clear()
        return hello, after

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._start_tls is not None:  # (uvloop's transports do not subclass Transport)
            self._raw = cast(asyncio.Transport, transport)
            self.hello_ready = asyncio.get_running_loop().create_future()
            self._start_tls(self, self._raw)
        else:
            self.secured(transport)

    def tls_started(self) -> None:
        """The TLS layer takes the connection over now: what arrives from here on is
        decrypted, and waits for :meth:`secured` (the TLS layer delivers the bytes that came
        with the end of its handshake at once, before the service learns that it is done)."""
        self._tls_started = True

    def secured(self, transport: asyncio.BaseTransport) -> None:
        """Hand the connection's (TLS, once its handshake is done) transport to the reader."""
        if self._start_tls is not None:  # until it authenticates (AgentConnection.run)
            set_tls_read_limit(transport, TLS_PREAUTH_READ_LIMIT)
        self._made = True
        self._inner.connection_made(transport)
        if self._decrypted:
            self._inner.data_received(bytes(self._decrypted))
            self._decrypted.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._made:  # before or during a TLS handshake: the service sees to it
            self.lost_early = True
            self._hello_done()
            return
        self._inner.connection_lost(exc)
        if self.sink_closed is not None:
            self.sink_closed(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def eof_received(self) -> bool | None:
        self._hello_done()  # no more of a hello is coming: the handshake says what is wrong
        keep_open = self._inner.eof_received()
        if self.sink_closed is not None:
            self.sink_closed(None)
        return keep_open

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._view
        if len(view) != self.reader.chunk:  # the peer authenticated: a larger chunk
            view = self._view = memoryview(self._shared)[: self.reader.chunk]
        return view

    def buffer_updated(self, nbytes: int) -> None:
        if self.sink is not None:
            self.sink(self._view[:nbytes])
        elif self._made:
            self._inner.data_received(bytes(self._shared[:nbytes]))
        elif self._tls_started:  # the peer's first frames, before the service calls secured()
            self._stash(self._decrypted, nbytes, 2 * self.reader.chunk)  # past it: not an agent
        else:  # the client hello, before the handshake starts (see tls_accept)
            self._stash(self.early, nbytes, TLS_EARLY_LIMIT)
            if self._hello.complete(self.early):
                self._hello_done()

    def _stash(self, buffer: bytearray, nbytes: int, limit: int) -> None:
        """Keep received bytes for later; a peer that sends more than ``limit`` is cut off."""
        buffer += self._shared[:nbytes]
        if len(buffer) > limit and self._raw is not None:
            self.lost_early = True
            buffer.clear()
            self._raw.abort()

    def _hello_done(self) -> None:
        if self.hello_ready is not None and not self.hello_ready.done():
            self.hello_ready.set_result(None)


#: the TLS record type of handshake messages (a client hello comes in one or more)
_TLS_HANDSHAKE_RECORD = 0x16
#: the TLS record type of a change cipher spec (TLS 1.3 sends one for middleboxes only)
_TLS_CHANGE_CIPHER_SPEC_RECORD = 0x14
#: the handshake message type of a client hello
_TLS_CLIENT_HELLO = 1


class ClientHelloWatch:
    """Tells when the bytes a TLS peer sent first hold its whole client hello.

    A hello may be split over several handshake records (TLS allows any fragmentation): a
    peer whose first record holds a few bytes of it would otherwise get a handshake turn for
    nothing, and send the rest later, when it chooses, together with as many such peers as it
    holds: the TLS layer then answers all of them in one loop turn (1,500 peers held the
    coordinator's loop for 1.5 s). :meth:`complete` is called with the same growing buffer
    each time and looks at each record once. With ``after_retry`` it watches the bytes that
    follow a first hello (see flowsched.coordinator.tls_accept): change cipher spec records
    before the hello are skipped (a TLS 1.3 client sends one before its second hello).
    """

    __slots__ = ("_after_retry", "_got", "_header", "_need", "_pos")

    def __init__(self, after_retry: bool = False) -> None:
        self._after_retry = after_retry
        self._pos = 0  # where the next record starts in the buffer
        self._header = bytearray()  # the hello's 4-byte handshake header, as it arrives
        self._need: int | None = None  # the hello's size with its header, once known
        self._got = 0  # handshake bytes in the whole records so far

    def complete(self, data: bytes | bytearray) -> bool:
        """Whether ``data`` (everything received so far) holds the whole client hello, or
        cannot be one at all (another record type or handshake message first), so that
        waiting for more would only delay the handshake's own error."""
        if not data:
            return False
        if self._need is not None and self._got >= self._need:
            return True  # (records after the hello are the next reader's: see records_end)
        while len(data) >= self._pos + 5:
            if not self._may_come(data[self._pos]):
                return True
            size = int.from_bytes(data[self._pos + 3 : self._pos + 5], "big")
            end = self._pos + 5 + size
            if len(data) < end:
                return False  # the TLS layer reads whole records only
            if data[self._pos] == _TLS_CHANGE_CIPHER_SPEC_RECORD:
                self._pos = end
                continue
            if self._need is None:
                self._header += data[self._pos + 5 : min(end, self._pos + 9 - len(self._header))]
                if len(self._header) == 4:
                    if self._header[0] != _TLS_CLIENT_HELLO:
                        return True
                    self._need = 4 + int.from_bytes(self._header[1:4], "big")
            self._got += size
            self._pos = end
            if self._need is not None and self._got >= self._need:
                return True
        return len(data) > self._pos and not self._may_come(data[self._pos])

    @property
    def hello_seen(self) -> bool:
        """Whether the records so far began a client hello (else they are something else)."""
        return self._need is not None

    @property
    def records_end(self) -> int:
        """Where the whole records looked at so far end in the buffer."""
        return self._pos

    def _may_come(self, record_type: int) -> bool:
        """Whether a record of ``record_type`` may come next in a client hello's records."""
        if record_type == _TLS_HANDSHAKE_RECORD:
            return True
        before_hello = self._after_retry and not self._header
        return before_hello and record_type == _TLS_CHANGE_CIPHER_SPEC_RECORD


def set_tls_read_limit(transport: asyncio.BaseTransport, high: int | None) -> None:
    """Bound the encrypted bytes a TLS transport holds for its protocol (None: its default).
    asyncio's and uvloop's TLS transports both have the method; a plain one has not."""
    limit = getattr(transport, "set_read_buffer_limits", None)
    if limit is not None and transport.get_extra_info("ssl_object") is not None:
        limit(high)


def peer_text(peer: object) -> str:
    """``host:port`` of a ``peername``."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


class ConnectionClosed(Exception):
    """Raised inside a connection to end it with ``code`` and ``reason`` (logged)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class AgentConnection:
    """Serves one agent from handshake to close (see the module docstring)."""

    def __init__(
        self,
        coordinator: Coordinator,
        protocol: BoundedReaderProtocol,
        writer: asyncio.StreamWriter,
    ) -> None:
        self._coordinator = coordinator
        self._config = coordinator.config
        self._protocol = protocol
        self._reader = protocol.reader
        self._writer = writer
        self._transport = writer.transport
        self._conn = Connection(
            Role.COORDINATOR, token=self._config.token, max_frame_size=self._config.max_frame_size,
            min_version=self._config.min_agent_version,
        )  # fmt: skip
        peer = writer.get_extra_info("peername")
        self.peer = peer_text(peer)
        self._abort: ConnectionClosed | None = None
        #: resolved (always with an exception) when the established connection ends
        self._ended: asyncio.Future[None] | None = None
        #: ``perf_counter()`` when the last bytes arrived, once established
        self._last_data = 0.0
        self._idle_suspected = False
        self._watchdog: asyncio.TimerHandle | None = None
        #: something was sent since the heartbeat loop last visited this connection
        self.sent_since_beat = False
        #: the reason code the connection was closed with (None while open)
        self.closed_with: str | None = None

    @property
    def node(self) -> str | None:
        """The node name the agent announced (None before its hello)."""
        return self._conn.node

    @property
    def peer_closed(self) -> bool:
        """Whether the agent closed this connection (its end may not be handled yet)."""
        return self._reader.eof_seen

    async def run(self) -> None:
        """Handshake, then handle messages until the connection ends; never raises."""
        established = False
        try:
            # one deadline for the whole handshake, the TLS one included: a peer dripping a
            # byte now and then cannot keep an unauthenticated connection open past it
            deadline = self._protocol.handshake_deadline
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self._config.handshake_timeout
            async with asyncio.timeout_at(deadline):
                await self._handshake()
            established = True
            self._reader.authenticated()
            set_tls_read_limit(self._writer.transport, None)  # TLS: the usual limit again
            self._coordinator.attach(self)
            await self._serve_established()
        except RemoteProtocolError as exc:
            self._reject(exc.code, exc.reason, established)
        except ConnectionClosed as exc:
            self._reject(exc.code, exc.reason, established)
        except TimeoutError:
            self._reject("timeout", self._timeout_reason(established), established)
        except CONNECTION_ERRORS as exc:
            self._reject("connection_lost", f"{type(exc).__name__}: {exc}", established)
        except Exception as exc:  # a bug: this connection ends, the service goes on
            self._coordinator.repeat_log.log(
                "internal", logging.ERROR, "unexpected error serving peer=%s node=%s",
                self.peer, self._conn.node, exc_info=exc,
            )  # fmt: skip
            self._reject("internal", f"internal error ({type(exc).__name__})", established)
        finally:
            self._forget_failure()
            self._protocol.sink = self._protocol.sink_closed = None
            if self._watchdog is not None:
                self._watchdog.cancel()
            if established:
                self._coordinator.detach(self)
            self._close(self.closed_with or "closed")

    def _forget_failure(self) -> None:
        """Drop the traceback of the exception that ended the established connection: its
        frames hold the future it was raised through and this connection, a cycle that only
        the cyclic garbage collector frees (rarely, after ``gc.freeze()``), and with them the
        receive buffer and whatever the last frame decoded into."""
        ended = self._ended
        if ended is not None and ended.done() and not ended.cancelled():
            failure = ended.exception()
            if failure is not None:
                failure.__traceback__ = None

    def _timeout_reason(self, established: bool) -> str:
        if established:
            return f"no byte for {time.perf_counter() - self._last_data:.1f} s"
        return f"handshake not finished within {self._config.handshake_timeout:g} s"

    # -- handshake ---------------------------------------------------------------------------

    async def _handshake(self) -> None:
        hello = await self._next_message()
        assert isinstance(hello, Hello)  # the state table allows nothing else first
        self._writer.write(self._conn.challenge())
        await self._next_message()  # auth: the MAC is checked by the Connection
        self._check_certificate_names(hello.node)
        refusal = self._coordinator.not_leader(hello.node)
        if refusal is not None:  # a standby: the agent goes to the leader (docs/ha.md)
            raise ConnectionClosed("not_leader", refusal)
        config, coordinator = self._config, self._coordinator
        welcome = Welcome(
            config.policy_text, config.timer_period, time.time(), config.heartbeat_interval,
            coordinator.epoch, coordinator.candidacy.cluster if coordinator.candidacy else 0,
        )  # fmt: skip
        self._writer.write(self._conn.send(welcome))

    def _check_certificate_names(self, node: str) -> None:
        """Under mutual TLS with ``tls_client_names="node"``, the client certificate must
        name ``node``: a node's key then logs in as that node only (the token cannot say
        which node its holder is)."""
        config = self._config
        if config.tls_client_ca is None or config.tls_client_names != "node":
            return
        names = tls.certificate_names(self._writer.get_extra_info("peercert"))
        if node not in names:
            shown = ", ".join(quoted(name, 64) for name in names[:8]) or "none"
            raise ConnectionClosed(
                "auth_failed",
                f"hello: node {quoted(node, 64)} is not a name of the client certificate "
                f"(its names: {shown}); --tls-client-names any admits any certificate as any node",
            )

    async def _next_message(self) -> Message:
        while True:
            event = self._conn.next_event()
            if event is NEED_DATA:
                self._conn.receive_data(await self._reader.read(READ_SIZE))
                continue
            return self._message_or_close(event)

    @staticmethod
    def _message_or_close(event: Event) -> Message:
        if event is PEER_CLOSED:
            raise ConnectionClosed("peer_closed", "peer closed the connection")
        if isinstance(event, Error):  # the peer's words: quoted, they cannot forge log lines
            raise ConnectionClosed(
                "peer_error", f"peer sent error {quoted(event.code)}: {quoted(event.reason)}"
            )
        assert not isinstance(event, Sentinel)
        return event

    # -- established -------------------------------------------------------------------------

    async def _serve_established(self) -> None:
        """Hand the transport's receive callback to this connection, and wait for the end."""
        loop = asyncio.get_running_loop()
        self._ended = ended = loop.create_future()
        reader, protocol = self._reader, self._protocol
        self._last_data = reader.last_data or time.perf_counter()
        # bytes that came along with the handshake: still in the reader, or already in the
        # Connection's buffer (frames pipelined right after auth)
        pending = reader.take_buffered()
        if pending:  # (b"" would mean the end of the stream)
            self._conn.receive_data(pending)
        protocol.sink, protocol.sink_closed = self._received, self._stream_ended
        if reader.eof_seen:
            self._conn.receive_data(b"")
        self._handle_frames(self._last_data)
        if self._abort is not None:
            raise self._abort
        self._watchdog = loop.call_later(self._config.idle_timeout, self._watch_idle)
        await ended

    def _received(self, data: memoryview) -> None:
        """The transport's receive callback: decode and handle every complete frame now."""
        ended = self._ended
        if ended is None or ended.done():
            return  # ending: what the peer sends after that is dropped
        # that instant, taken when the event loop hands the bytes over, is the arrival time
        # of their frames for the decision-latency metric (it includes any wait for the loop)
        self._last_data = arrival = time.perf_counter()
        try:
            self._conn.receive_data(data)
            self._handle_frames(arrival)
        except Exception as exc:  # ends this connection only; run() says why
            self._end(exc)

    def _handle_frames(self, arrival: float) -> None:
        handle, conn, node = self._coordinator.handle, self._conn, self._conn.node
        assert node is not None
        message_or_close = self._message_or_close
        # a frame's handling may abort this connection (its levels overflowed the send
        # queue): the frames after it in the chunk must not act on the state
        while self._abort is None and (event := conn.next_event()) is not NEED_DATA:
            handle(node, message_or_close(event), arrival)

    def _stream_ended(self, exc: Exception | None) -> None:
        """The peer's EOF (``exc`` None) or the transport's error; frames before an EOF are
        handled first."""
        if exc is not None:
            self._end(exc)
        else:
            self._received_eof()

    def _received_eof(self) -> None:
        ended = self._ended
        if ended is None or ended.done():
            return
        try:  # the frames before the EOF, then PEER_CLOSED (or a frame cut short) raises
            self._conn.receive_data(b"")
            self._handle_frames(time.perf_counter())
        except Exception as exc:
            self._end(exc)
        self._end(ConnectionClosed("peer_closed", "peer closed the connection"))

    def _end(self, exc: BaseException) -> None:
        ended = self._ended
        if ended is not None and not ended.done():
            ended.set_exception(exc)

    def _watch_idle(self) -> None:
        """One timer per connection, rescheduled when it fires: the connection is idle once
        no byte arrived for ``idle_timeout`` seconds."""
        idle = self._config.idle_timeout
        loop = asyncio.get_running_loop()
        silent = time.perf_counter() - self._last_data
        if silent < idle:
            self._idle_suspected = False
            self._watchdog = loop.call_later(idle - silent, self._watch_idle)
        elif not self._idle_suspected:
            # On an overloaded loop the timer can fire before the loop polled the sockets
            # again (a loop turn longer than `idle`): let it poll once more before deciding.
            self._idle_suspected = True
            self._watchdog = loop.call_later(IDLE_RECHECK, self._watch_idle)
        else:
            self._watchdog = None
            self._end(TimeoutError())

    def send(self, message: Message) -> None:
        """Queue ``message`` for the agent; a stuck agent (send queue full) is disconnected."""
        if self._writable():
            self._transport.write(self._conn.send(message))
            self.sent_since_beat = True

    def send_frame(self, kind: str, data: bytes) -> None:
        """Queue an already encoded frame of message type ``kind`` (one encoding for every
        agent, such as a heartbeat); like :meth:`send` otherwise."""
        if self._writable():
            self._transport.write(self._conn.send_frame(kind, data))

    def _writable(self) -> bool:
        transport = self._transport
        # not once the connection failed (its end waits for the next loop turn) or closes
        if self._abort is not None or self._conn.state is not State.ESTABLISHED:
            return False
        if transport.is_closing():
            return False
        if transport.get_write_buffer_size() > self._config.send_buffer_limit:
            self.abort("send_overflow", f"send queue over {self._config.send_buffer_limit} bytes")
            return False
        return True

    def abort(self, code: str, reason: str, *, tell_peer: bool = False) -> None:
        """End this connection from outside (replaced by a newer one, stuck, shutdown);
        ``tell_peer`` sends the agent an ``error`` frame saying why first."""
        if self._abort is None:
            self._abort = ConnectionClosed(code, reason)
            if tell_peer:
                self._send_error(code, reason)
            self._close(code)
            self._end(self._abort)

    # -- closing -----------------------------------------------------------------------------

    def _close(self, code: str) -> None:
        """Close the transport (once) as ``code`` asks: aborted at once (:data:`ABORT_CODES`),
        else gracefully, aborted if the peer has not taken the queued bytes within
        :data:`CLOSE_TIMEOUT` seconds."""
        transport = self._writer.transport
        if code in ABORT_CODES:
            transport.abort()
        elif not transport.is_closing():
            self._writer.close()
            if transport.get_write_buffer_size():  # else closed at once
                asyncio.get_running_loop().call_later(CLOSE_TIMEOUT, transport.abort)

    def _reject(self, code: str, reason: str, established: bool) -> None:
        if self._abort is not None and code in ("peer_closed", "connection_lost"):
            code, reason = self._abort.code, self._abort.reason
        self.closed_with = code
        self._coordinator.count_rejection(code, in_handshake=not established)
        quiet = ("peer_closed", "shutdown", "replaced", "not_leader")
        level = logging.INFO if code in quiet else logging.WARNING
        text = "closing connection peer=%s node=%s state=%s: %s: %s"
        limit = 2 * PEER_TEXT_LIMIT
        shown = reason if len(reason) <= limit else f"{reason[:limit]}..."
        args = (self.peer, self._conn.node, self._conn.state.value, code, shown)
        if established:
            log.log(level, text, *args)
        else:  # a flood of bad peers must not flood the log: once, then at a falling rate
            self._coordinator.repeat_log.log(f"handshake:{code}", level, text, *args)
        self._send_error(code, reason)

    def _send_error(self, code: str, reason: str) -> None:
        if self._conn.state is not State.CLOSED and not self._writer.transport.is_closing():
            self._writer.write(self._conn.send_error(code, reason))
