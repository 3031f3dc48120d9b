"""TLS on the coordinator's agent listener: one accepted connection's handshake.

The listener accepts plain TCP and the service starts TLS on each connection itself
(``loop.start_tls``) instead of giving the listener an ``ssl`` context: asyncio and uvloop
report a failed server-side handshake only at debug level and without the peer, and an
operator needs both to find the agent with the wrong certificate. The service also counts
handshakes under way against its connection caps (flowsched.coordinator.service).

One wrinkle: uvloop starts reading a socket right after ``connection_made``, whatever the
protocol asked, so the first bytes of the peer's TLS hello may reach our protocol before the
handshake starts (:class:`~flowsched.coordinator.connection.BoundedReaderProtocol` keeps them
in ``early``). :func:`handshake` hands them to the TLS layer that ``start_tls`` installs,
which buffers them until its own ``connection_made``. asyncio's loop honours the pause.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import cast

from flowsched.coordinator.connection import BoundedReaderProtocol


async def handshake(
    raw: asyncio.Transport, protocol: BoundedReaderProtocol, context: ssl.SSLContext, timeout: float
) -> asyncio.BaseTransport | None:
    """Run the server side of ``raw``'s TLS handshake; the TLS transport (whose protocol is
    ``protocol``), or None when the peer closed during it.

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
