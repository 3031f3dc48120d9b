"""TLS on the coordinator's agent listener: one accepted connection's handshake.

The listener accepts plain TCP and the service starts TLS on each connection itself
(``loop.start_tls``) instead of giving the listener an ``ssl`` context: asyncio and uvloop
report a failed server-side handshake only at debug level and without the peer, and an
operator needs both to find the agent with the wrong certificate. The service also counts
handshakes under way against its connection caps (flowsched.coordinator.service).

A handshake starts only once the peer's whole client hello has arrived
(:class:`~flowsched.coordinator.connection.BoundedReaderProtocol` keeps it in ``early``, at
most ``TLS_EARLY_LIMIT`` bytes), and at most :data:`HANDSHAKES_PER_TURN` start per event-loop
turn (:class:`HandshakePace`). Answering a hello is the expensive step (key exchange and
signature, about a millisecond in all): a flood of hellos arriving together would otherwise
be answered in one loop turn, and a turn of seconds silences the heartbeats of every agent.
A peer that sends half a hello holds only its bytes, never a handshake slot.
:func:`handshake` hands the buffered hello to the TLS layer that ``start_tls`` installs,
which buffers it until its own ``connection_made``, and puts a :class:`RetryHelloGate` between
the socket and the TLS layer: a TLS 1.3 peer whose first hello offers no key share the
coordinator takes gets a cheap HelloRetryRequest, and its second hello, which costs the key
exchange and the signature, waits for a turn too. The gate leaves once the bytes after the
first hello show that no second hello comes (or once it passed the second one on).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from typing import cast

from flowsched.coordinator.connection import (
    CLOSE_TIMEOUT,
    TLS_EARLY_LIMIT,
    BoundedReaderProtocol,
    ClientHelloWatch,
)

#: TLS handshakes the coordinator starts per event-loop turn at most
HANDSHAKES_PER_TURN = 16
#: bytes a :class:`RetryHelloGate` receives at once
GATE_CHUNK = 4096


class HandshakePace:
    """Lets at most ``per_turn`` callers of :meth:`turn` through per event-loop turn, first
    come first served."""

    def __init__(self, per_turn: int = HANDSHAKES_PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError("per_turn must be at least 1")
        self.per_turn = per_turn
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._armed = False  # a _next_turn is scheduled

    async def turn(self) -> None:
        """Return in a later loop turn that has room for this caller."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._next_turn)
        await future  # cancelled: _next_turn skips it

    def _next_turn(self) -> None:
        # One run per loop turn while callers wait (it re-arms itself for the next turn):
        # the callers it wakes resume in the next turn, so no turn resumes more than per_turn.
        self._armed = False
        woken = 0
        while self._waiting and woken < self.per_turn:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                woken += 1
        if self._waiting:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._next_turn)


async def handshake(
    raw: asyncio.Transport,
    protocol: BoundedReaderProtocol,
    context: ssl.SSLContext,
    timeout: float,
    pace: HandshakePace,
) -> asyncio.BaseTransport | None:
    """Run the server side of ``raw``'s TLS handshake (the peer's hello is in
    ``protocol.early``; a second hello, after a HelloRetryRequest, waits for a turn of
    ``pace``); the TLS transport (whose protocol is ``protocol``), or None when the peer
    closed during it.

    Raises:
        ssl.SSLError, ConnectionError, TimeoutError: as ``loop.start_tls``.
    """
    loop = asyncio.get_running_loop()
    raw.pause_reading()  # effective from here on under uvloop too
    hello, after = protocol.take_early()
    # runs right after start_tls installs the TLS layer, before its connection_made
    loop.call_soon(_replay, raw, protocol, hello, RetryHelloGate(raw, pace, after))
    protocol.tls_started()
    # a close waits CLOSE_TIMEOUT at most for the peer, as without TLS (AgentConnection._close):
    # the TLS layer's default of 30 s for its close_notify held a refused peer's socket that
    # long, outside the connection caps
    return await loop.start_tls(
        raw, protocol, context, server_side=True, ssl_handshake_timeout=timeout,
        ssl_shutdown_timeout=CLOSE_TIMEOUT,
    )  # fmt: skip


class RetryHelloGate(asyncio.BufferedProtocol):
    """Stands between a raw transport and its TLS layer from the peer's first client hello
    on, so that a second hello (the answer to a HelloRetryRequest) waits for a pace turn too.

    The bytes after the first hello are held until they show what comes next. A client hello
    (after any change cipher spec records) is held until whole, then waits for a turn of the
    pace; anything else (the rest of a handshake) goes to the TLS layer at once. Either way
    the gate then hands the transport back to the TLS layer and is out of the way. It holds
    at most ``TLS_EARLY_LIMIT`` bytes (a peer that sends more is cut off); the peer's end of
    stream waits with the bytes before it.
    """

    __slots__ = ("_chunk", "_eof", "_held", "_pace", "_raw", "_tls_layer", "_waiting", "_watch")

    def __init__(self, raw: asyncio.Transport, pace: HandshakePace, held: bytes) -> None:
        self._raw = raw
        self._pace = pace
        self._held = bytearray(held)
        self._tls_layer: asyncio.BufferedProtocol | None = None  # set by install()
        self._watch = ClientHelloWatch(after_retry=True)
        self._chunk: bytearray | None = None  # receives into it; made at the first read
        self._waiting: asyncio.Task[None] | None = None  # for the pace turn
        self._eof = False  # the peer's end of stream came and waits for the held bytes

    def install(self, tls_layer: asyncio.BufferedProtocol) -> None:
        """Take the raw transport's bytes before ``tls_layer`` (which it had) sees them."""
        self._tls_layer = tls_layer
        self._raw.set_protocol(self)
        self._look()  # what came with the first hello

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._chunk is None:
            self._chunk = bytearray(GATE_CHUNK)
        return memoryview(self._chunk)

    def buffer_updated(self, nbytes: int) -> None:
        assert self._chunk is not None
        if len(self._held) + nbytes > TLS_EARLY_LIMIT:
            self._held.clear()
            self._raw.abort()  # no hello is that long: not a TLS client
            return
        self._held += self._chunk[:nbytes]
        if self._waiting is None:
            self._look()

    def eof_received(self) -> bool | None:
        if self._waiting is not None:
            self._eof = True
            return True  # keep the transport open: the held hello's turn passes it on
        self._hand_over()  # a hello cut short costs the TLS layer nothing
        return self._layer().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
        self._held.clear()
        self._layer().connection_lost(exc)

    def pause_writing(self) -> None:
        self._layer().pause_writing()

    def resume_writing(self) -> None:
        self._layer().resume_writing()

    def _look(self) -> None:
        if not self._watch.complete(self._held):
            return
        if not self._watch.hello_seen:
            self._hand_over()
            return
        self._waiting = asyncio.ensure_future(self._hand_over_in_turn())

    async def _hand_over_in_turn(self) -> None:
        await self._pace.turn()
        if self._raw.is_closing():  # its connection_lost is on its way: answer nobody
            return
        self._hand_over()
        if self._eof and not self._layer().eof_received():
            self._raw.close()

    def _hand_over(self) -> None:
        self._raw.set_protocol(self._layer())
        held, self._held, self._chunk = bytes(self._held), bytearray(), None
        if held:
            _feed(self._layer(), held)

    def _layer(self) -> asyncio.BufferedProtocol:
        assert self._tls_layer is not None
        return self._tls_layer


def failure_reason(exc: BaseException) -> str:
    """Why a handshake failed, in words (also the key of its rate-limited log line)."""
    if isinstance(exc, TimeoutError):
        return "no TLS handshake within the handshake timeout"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"client certificate rejected: {exc.verify_message}"
    reason = getattr(exc, "reason", None)
    if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "RECORD_LAYER_FAILURE"):
        return f"not TLS ({reason}): an agent without TLS?"
    if reason:
        return str(reason).lower().replace("_", " ")
    return f"{type(exc).__name__} {exc}".strip()


def _replay(
    raw: asyncio.Transport, protocol: BoundedReaderProtocol, hello: bytes, gate: RetryHelloGate
) -> None:
    """Feed the hello received before ``start_tls`` to the TLS layer it installed (its
    connection_made comes next; until then it only buffers it), and put ``gate`` before it."""
    tls_layer = raw.get_protocol()  # (uvloop's does not subclass BufferedProtocol)
    if tls_layer is protocol or not hasattr(tls_layer, "buffer_updated"):
        raw.abort()  # start_tls did not take the connection over: nothing can read these
        return
    target = cast(asyncio.BufferedProtocol, tls_layer)
    _feed(target, hello)
    gate.install(target)


def _feed(target: asyncio.BufferedProtocol, data: bytes) -> None:
    """Hand ``data`` to ``target`` as its transport would."""
    view = memoryview(data)
    while view:
        buffer = memoryview(target.get_buffer(len(view)))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        target.buffer_updated(size)
        view = view[size:]
