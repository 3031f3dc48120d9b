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
which buffers it until its own ``connection_made``.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from typing import cast

from flowsched.coordinator.connection import BoundedReaderProtocol

#: TLS handshakes the coordinator starts per event-loop turn at most
HANDSHAKES_PER_TURN = 16


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
    raw: asyncio.Transport, protocol: BoundedReaderProtocol, context: ssl.SSLContext, timeout: float
) -> asyncio.BaseTransport | None:
    """Run the server side of ``raw``'s TLS handshake (the peer's hello is in
    ``protocol.early``); the TLS transport (whose protocol is ``protocol``), or None when the
    peer closed during it.

    Raises:
        ssl.SSLError, ConnectionError, TimeoutError: as ``loop.start_tls``.
    """
    loop = asyncio.get_running_loop()
    raw.pause_reading()  # effective from here on under uvloop too
    if protocol.early:  # replayed right after start_tls installs the TLS layer
        loop.call_soon(_replay, raw, protocol, bytes(protocol.early))
        protocol.early.clear()
    protocol.tls_started()
    return await loop.start_tls(
        raw, protocol, context, server_side=True, ssl_handshake_timeout=timeout
    )


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


def _replay(raw: asyncio.Transport, protocol: BoundedReaderProtocol, data: bytes) -> None:
    """Feed bytes received before ``start_tls`` to the TLS layer it installed (its
    connection_made comes next; until then it only buffers them)."""
    tls_layer = raw.get_protocol()  # (uvloop's does not subclass BufferedProtocol)
    if tls_layer is protocol or not hasattr(tls_layer, "buffer_updated"):
        raw.abort()  # start_tls did not take the connection over: nothing can read these
        return
    target = cast(asyncio.BufferedProtocol, tls_layer)
    view = memoryview(data)
    while view:
        buffer = memoryview(target.get_buffer(len(view)))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        target.buffer_updated(size)
        view = view[size:]
