"""Thin asyncio adapter for agents: connect, authenticate, then send and receive messages.

This is the only module of :mod:`flowsched.protocol` that does I/O; all protocol logic is in
the sans-IO :class:`~flowsched.protocol.Connection`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl

from flowsched.protocol._connection import NEED_DATA, PEER_CLOSED, Connection, Sentinel
from flowsched.protocol._framing import DEFAULT_MAX_FRAME_SIZE
from flowsched.protocol._messages import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Challenge,
    Error,
    Hello,
    Message,
    Welcome,
)
from flowsched.protocol._state import Role
from flowsched.protocol._util import ProtocolError

log = logging.getLogger(__name__)

_READ_SIZE = 1 << 16
#: seconds a graceful close may wait for the send buffer to drain before the socket is reset
CLOSE_TIMEOUT = 1.0


class LinkClosed(ConnectionError):
    """The coordinator closed the connection (``error`` carries its error frame, if any)."""

    def __init__(self, reason: str, error: Error | None = None) -> None:
        super().__init__(reason)
        self.error = error


class HandshakeError(ConnectionError):
    """The coordinator refused the handshake (bad token, version, ...): ``code`` says why."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"coordinator refused the handshake: {code}: {reason}")
        self.code = code
        self.reason = reason


class AgentLink:
    """An authenticated connection to the coordinator (use :func:`connect_agent`)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._conn = conn
        self.welcome: Welcome | None = None

    @property
    def cipher(self) -> tuple[str, str, int] | None:
        """(cipher, TLS version, secret bits) of a TLS link; None over plain TCP."""
        found: tuple[str, str, int] | None = self._writer.get_extra_info("cipher")
        return found

    @property
    def version(self) -> int:
        """The protocol version agreed with the coordinator (see :mod:`flowsched.protocol`)."""
        return self._conn.version

    async def send(self, message: Message) -> None:
        """Send one message (waits while the socket's send buffer is full)."""
        self._writer.write(self._conn.send(message))
        await self._writer.drain()

    async def recv(self, timeout: float | None = None) -> Message:
        """The next message from the coordinator (heartbeats included).

        Raises:
            LinkClosed: the coordinator closed the connection or sent an ``error`` frame.
            TimeoutError: nothing arrived within ``timeout`` seconds.
            RemoteProtocolError: the coordinator broke the protocol.
        """
        async with asyncio.timeout(timeout):
            while True:
                event = self._conn.next_event()
                if event is NEED_DATA:
                    self._conn.receive_data(await self._reader.read(_READ_SIZE))
                elif event is PEER_CLOSED:
                    raise LinkClosed("coordinator closed the connection")
                elif isinstance(event, Error):
                    raise LinkClosed(f"coordinator error {event.code}: {event.reason}", event)
                elif not isinstance(event, Sentinel):
                    return event

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close the connection (never raises for an already-broken socket).

        A peer that stops reading would hold a graceful close (which flushes the send buffer
        first) forever: after ``timeout`` seconds the connection is aborted instead.
        """
        self._writer.close()
        try:
            with contextlib.suppress(ConnectionError, OSError):
                async with asyncio.timeout(timeout):
                    await self._writer.wait_closed()
        except TimeoutError:
            self._writer.transport.abort()


async def connect_agent(
    host: str,
    port: int,
    *,
    node: str,
    token: bytes,
    timeout: float = 5.0,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    version: int = PROTOCOL_VERSION,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> AgentLink:
    """Open a connection to the coordinator and run the handshake.

    The hello offers protocol ``version``; a coordinator of the previous release refuses any
    version but 1 (code ``version``), and then this reconnects once offering
    :data:`MIN_PROTOCOL_VERSION`, so that a newer agent keeps working during a rolling
    upgrade (and sends what that coordinator decodes).

    Args:
        host, port: the coordinator's ``--listen`` address.
        node: this agent's node name (flow ids are unique per node).
        token: the shared token (see :func:`flowsched.protocol.load_token`).
        timeout: seconds allowed for the connect and for each handshake step.
        version: the highest protocol version to offer.
        tls: connect over TLS with this context (:func:`flowsched.tls.client_context`).
        server_hostname: the name the coordinator's certificate must carry (default: host).

    Returns:
        The established link; ``link.welcome`` holds the coordinator's welcome and
        ``link.version`` the version agreed.

    Raises:
        HandshakeError: the coordinator answered with an error (wrong token, version, ...), or
            the TLS handshake failed (code ``tls``).
        TimeoutError, OSError: the coordinator is unreachable or too slow.
    """
    secure = _Secure(tls, server_hostname)
    try:
        return await _connect_once(
            host, port, node, token, timeout, max_frame_size, version, secure
        )
    except HandshakeError as exc:
        if exc.code != "version" or version <= MIN_PROTOCOL_VERSION:
            raise
        log.info(
            "coordinator %s:%d refused protocol version %d (%s); reconnecting with version %d",
            host, port, version, exc.reason, MIN_PROTOCOL_VERSION,
        )  # fmt: skip
    return await _connect_once(
        host, port, node, token, timeout, max_frame_size, MIN_PROTOCOL_VERSION, secure
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Secure:
    context: ssl.SSLContext | None
    server_hostname: str | None


async def _connect_once(
    host: str,
    port: int,
    node: str,
    token: bytes,
    timeout: float,
    max_frame_size: int,
    version: int,
    secure: _Secure,
) -> AgentLink:
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=secure.context,
                server_hostname=(secure.server_hostname or host) if secure.context else None,
            )  # fmt: skip
        conn = Connection(Role.AGENT, token=token, max_frame_size=max_frame_size, version=version)
        link = AgentLink(reader, writer, conn)
        try:
            link.welcome = await _handshake(link, node, timeout)
        except BaseException:
            await link.close()
            raise
    except ssl.SSLError as exc:  # TLS 1.3 reports a refused client certificate on first read
        raise HandshakeError("tls", _tls_failure(exc)) from None
    except HandshakeError as exc:
        if exc.code in ("closed", "frame_too_large"):
            raise HandshakeError(exc.code, f"{exc.reason} ({_closed_hint(secure)})") from None
        raise
    return link


def _closed_hint(secure: _Secure) -> str:
    if secure.context is None:
        return "a coordinator that serves TLS closes plain connections: connect with TLS"
    return (
        "a coordinator that asks for client certificates closes connections without a client "
        "certificate it trusts"
    )


def _tls_failure(exc: ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the coordinator's certificate failed verification: {exc.verify_message}"
    return (
        f"TLS handshake failed ({exc.reason or exc}): does the coordinator serve TLS, and "
        "accept this agent's certificate if it asks for one?"
    )


async def _handshake(link: AgentLink, node: str, timeout: float) -> Welcome:
    await link.send(Hello(link.version, node))
    try:
        challenge = await link.recv(timeout)
        if not isinstance(challenge, Challenge):
            raise HandshakeError("bad_state", f"expected challenge, got {challenge.TYPE}")
        link._writer.write(link._conn.answer(challenge))
        welcome = await link.recv(timeout)
    except LinkClosed as exc:
        if exc.error is not None:
            raise HandshakeError(exc.error.code, exc.error.reason) from None
        raise HandshakeError("closed", str(exc)) from None
    except ProtocolError as exc:
        raise HandshakeError(exc.code, exc.reason) from None
    if not isinstance(welcome, Welcome):
        raise HandshakeError("bad_state", f"expected welcome, got {welcome.TYPE}")
    return welcome
