"""One agent connection: the only code that touches a client's StreamReader/StreamWriter.

It feeds received bytes to the sans-IO :class:`~flowsched.protocol.Connection`, hands decoded
messages to the coordinator, and turns every failure into a close with a logged reason:
protocol errors (answered with an ``error`` frame first), timeouts, and the connection errors
listed in :data:`CONNECTION_ERRORS`. A failure never propagates beyond this connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, SupportsIndex

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

    def has_buffered_data(self) -> bool:
        """Whether bytes are waiting to be read (then a timeout is our backlog, not idleness)."""
        return bool(self._buffer)  # type: ignore[attr-defined]  # StreamReader's own buffer


class BoundedReaderProtocol(asyncio.BufferedProtocol):
    """Serves a StreamReaderProtocol, but the transport receives into a ``reader.chunk`` buffer.

    A plain protocol gets whatever the socket holds (up to 256 KiB per receive with uvloop)
    before anyone looks at it: 1,500 peers each sending the start of a 1 MiB first frame then
    cost 64 KiB or more of memory each at once. Receiving at most one handshake frame per call
    (the reader pauses the socket at twice that) leaves an unauthenticated peer's bytes in the
    kernel. This wraps rather than subclasses StreamReaderProtocol: uvloop treats any
    ``asyncio.Protocol`` as unbuffered. ``shared`` is one buffer for every connection of a
    loop: the transport calls ``get_buffer`` and ``buffer_updated`` back to back for one
    connection at a time.
    """

    def __init__(
        self,
        reader: TimedStreamReader,
        client_connected_cb: Callable[[asyncio.StreamReader, asyncio.StreamWriter], None],
        shared: bytearray,
    ) -> None:
        self._inner = asyncio.StreamReaderProtocol(reader, client_connected_cb)
        self._reader = reader
        self._shared = shared

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._shared)[: self._reader.chunk]

    def buffer_updated(self, nbytes: int) -> None:
        self._inner.data_received(bytes(self._shared[:nbytes]))


class ConnectionClosed(Exception):
    """Raised inside a connection to end it with ``code`` and ``reason`` (logged)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class AgentConnection:
    """Serves one agent from handshake to close (see the module docstring)."""

    def __init__(
        self, coordinator: Coordinator, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._coordinator = coordinator
        self._config = coordinator.config
        self._reader = reader
        self._writer = writer
        self._conn = Connection(
            Role.COORDINATOR, token=self._config.token, max_frame_size=self._config.max_frame_size
        )
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._abort: ConnectionClosed | None = None

    @property
    def node(self) -> str | None:
        """The node name the agent announced (None before its hello)."""
        return self._conn.node

    @property
    def peer_closed(self) -> bool:
        """Whether the agent closed this connection (its end may not be handled yet)."""
        reader = self._reader
        return isinstance(reader, TimedStreamReader) and reader.eof_seen

    async def run(self) -> None:
        """Handshake, then read messages until the connection ends; never raises."""
        established = False
        try:
            # one deadline for the whole handshake: a peer dripping a byte now and then
            # cannot keep an unauthenticated connection open past it
            async with asyncio.timeout(self._config.handshake_timeout):
                await self._handshake()
            established = True
            if isinstance(self._reader, TimedStreamReader):
                self._reader.authenticated()
            self._coordinator.attach(self)
            await self._read_loop()
        except RemoteProtocolError as exc:
            self._reject(exc.code, exc.reason, established)
        except ConnectionClosed as exc:
            self._reject(exc.code, exc.reason, established)
        except TimeoutError:
            self._reject("timeout", self._timeout_reason(established), established)
        except CONNECTION_ERRORS as exc:
            self._reject("connection_lost", f"{type(exc).__name__}: {exc}", established)
        finally:
            if established:
                self._coordinator.detach(self)
            self._writer.close()

    def _timeout_reason(self, established: bool) -> str:
        if established:
            reader = self._reader
            if isinstance(reader, TimedStreamReader):
                return f"no byte for {time.perf_counter() - reader.last_data:.1f} s"
            return f"no frame for {self._config.idle_timeout:g} s"
        return f"handshake not finished within {self._config.handshake_timeout:g} s"

    # -- handshake ---------------------------------------------------------------------------

    async def _handshake(self) -> None:
        hello = await self._next_message()
        assert isinstance(hello, Hello)  # the state table allows nothing else first
        self._writer.write(self._conn.challenge())
        await self._next_message()  # auth: the MAC is checked by the Connection
        refusal = self._coordinator.not_leader()
        if refusal is not None:  # a standby: the agent goes to the leader (docs/ha.md)
            raise ConnectionClosed("not_leader", refusal)
        config, coordinator = self._config, self._coordinator
        welcome = Welcome(
            config.policy_text, config.timer_period, time.time(), config.heartbeat_interval,
            coordinator.epoch, coordinator.candidacy.cluster if coordinator.candidacy else 0,
        )  # fmt: skip
        self._writer.write(self._conn.send(welcome))

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
        if isinstance(event, Error):
            raise ConnectionClosed("peer_error", f"peer sent error {event.code}: {event.reason}")
        assert not isinstance(event, Sentinel)
        return event

    # -- established -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        idle = self._config.idle_timeout
        coordinator = self._coordinator
        node = self._conn.node
        assert node is not None
        arrival = time.perf_counter()  # frames that came along with the handshake
        while True:
            while (event := self._conn.next_event()) is not NEED_DATA:
                coordinator.handle(node, self._message_or_close(event), arrival)
            if self._abort is not None:
                raise self._abort
            data = await self._read_established(idle)
            arrival = getattr(self._reader, "last_data", None) or time.perf_counter()
            self._conn.receive_data(data)

    async def _read_established(self, idle: float) -> bytes:
        while True:
            try:
                async with asyncio.timeout(idle):
                    return await self._reader.read(READ_SIZE)
            except TimeoutError:
                if not await self._really_idle(idle):
                    continue
                raise

    async def _really_idle(self, idle: float) -> bool:
        # On an overloaded loop the timer can fire before the loop polled the socket again
        # (a loop turn longer than `idle`: the loop's cached clock makes the deadline stale,
        # or our own backlog kept the transport paused). Let the loop poll once more; only a
        # reader with nothing buffered that saw no byte for `idle` seconds is idle.
        reader = self._reader
        if not isinstance(reader, TimedStreamReader):
            return True
        await asyncio.sleep(IDLE_RECHECK)  # a real sleep: the loop polls the socket meanwhile
        return not reader.has_buffered_data() and time.perf_counter() - reader.last_data >= idle

    def send(self, message: Message) -> None:
        """Queue ``message`` for the agent; a stuck agent (send queue full) is disconnected."""
        transport = self._writer.transport
        if self._abort is not None or transport.is_closing():
            return
        if transport.get_write_buffer_size() > self._config.send_buffer_limit:
            self.abort("send_overflow", f"send queue over {self._config.send_buffer_limit} bytes")
            return
        self._writer.write(self._conn.send(message))

    def abort(self, code: str, reason: str, *, tell_peer: bool = False) -> None:
        """End this connection from outside (replaced by a newer one, stuck, shutdown);
        ``tell_peer`` sends the agent an ``error`` frame saying why first."""
        if self._abort is None:
            self._abort = ConnectionClosed(code, reason)
            if tell_peer:
                self._send_error(code, reason)
            self._writer.close()

    # -- closing -----------------------------------------------------------------------------

    def _reject(self, code: str, reason: str, established: bool) -> None:
        if self._abort is not None and code in ("peer_closed", "connection_lost"):
            code, reason = self._abort.code, self._abort.reason
        self._coordinator.count_rejection(code)
        quiet = ("peer_closed", "shutdown", "replaced", "not_leader")
        level = logging.INFO if code in quiet else logging.WARNING
        text = "closing connection peer=%s node=%s state=%s: %s: %s"
        args = (self.peer, self._conn.node, self._conn.state.value, code, reason)
        if established:
            log.log(level, text, *args)
        else:  # a flood of bad peers must not flood the log: once, then at a falling rate
            self._coordinator.repeat_log.log(f"handshake:{code}", level, text, *args)
        self._send_error(code, reason)

    def _send_error(self, code: str, reason: str) -> None:
        if self._conn.state is not State.CLOSED and not self._writer.transport.is_closing():
            self._writer.write(self._conn.send_error(code, reason))
