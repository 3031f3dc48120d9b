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
    FRAME_MAC_VERSION,
    MIN_PROTOCOL_VERSION,
    MUTUAL_AUTH_VERSION,
    PROTOCOL_VERSION,
    Challenge,
    Error,
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
    """The handshake failed: ``code`` says why. The coordinator refused it (bad token,
    version, ...), or, with ``by_agent``, this agent refused the coordinator (code
    ``auth_failed``: its welcome did not prove it holds the token; ``unproven_coordinator``:
    it speaks a version that cannot prove it; or it broke the protocol)."""

    def __init__(self, code: str, reason: str, *, by_agent: bool = False) -> None:
        if by_agent:
            super().__init__(f"{code}: {reason}")
        else:
            super().__init__(f"coordinator refused the handshake: {code}: {reason}")
        self.code = code
        self.reason = reason
        self.by_agent = by_agent


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

    @property
    def sealed(self) -> bool:
        """Whether the frames after the handshake carry MACs (version 5 on)."""
        return self._conn.sealed

    @property
    def coordinator_proven(self) -> bool:
        """Whether the coordinator proved at the handshake that it holds the token (its
        welcome MAC, version 3 on); False for an older coordinator, accepted only over
        verified TLS or with ``allow_unproven``."""
        return self._conn.peer_proven

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
            async with asyncio.timeout(timeout):
                await self._writer.wait_closed()
        except TimeoutError:  # an OSError too: caught before those of a broken socket
            self._writer.transport.abort()
        except (ConnectionError, OSError):
            pass


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
    allow_unproven: bool = False,
) -> AgentLink:
    """Open a connection to the coordinator and run the handshake.

    The hello offers protocol ``version``. From version 3 on, the coordinator proves that it
    holds the token by its welcome MAC, which is checked. A coordinator that agrees on a lower
    version cannot prove it: it is refused (``HandshakeError`` code
    ``unproven_coordinator``) unless ``tls`` verifies the coordinator's certificate and name,
    or ``allow_unproven`` is set (a rolling upgrade that starts with the agents). A
    coordinator of the previous release refuses any version but 1 (code ``version``; and a
    version-3 hello's nonce as an unknown field): where it may be accepted, this reconnects
    once offering :data:`MIN_PROTOCOL_VERSION`, so that a newer agent keeps working during a
    rolling upgrade (and sends what that coordinator decodes).

    Args:
        host, port: the coordinator's ``--listen`` address.
        node: this agent's node name (flow ids are unique per node).
        token: the shared token (see :func:`flowsched.protocol.load_token`).
        timeout: seconds allowed for the connect and for each handshake step.
        version: the highest protocol version to offer.
        tls: connect over TLS with this context (:func:`flowsched.tls.client_context`).
        server_hostname: the name the coordinator's certificate must carry (default: host).
        allow_unproven: accept a coordinator that speaks a version below 3 over plain TCP (or
            TLS that does not verify it), which cannot prove that it holds the token.

    Returns:
        The established link; ``link.welcome`` holds the coordinator's welcome,
        ``link.version`` the version agreed and ``link.coordinator_proven`` whether the
        coordinator proved it holds the token.

    Raises:
        HandshakeError: the coordinator answered with an error (wrong token, version, ...),
            the TLS handshake failed (code ``tls``), or (``by_agent``) this agent refused the
            coordinator: a missing or wrong welcome MAC (``auth_failed``), or a version that
            cannot prove the coordinator (``unproven_coordinator``).
        TimeoutError, OSError: the coordinator is unreachable or too slow.
    """
    secure = _Secure(tls, server_hostname, allow_unproven)
    try:
        return await _connect_once(
            host, port, node, token, timeout, max_frame_size, version, secure
        )
    except HandshakeError as exc:
        if not _refused_offer(exc) or version <= MIN_PROTOCOL_VERSION:
            raise
        if version >= MUTUAL_AUTH_VERSION and not secure.may_skip_proof():
            raise _unproven(f"refused protocol version {version} ({exc.reason})") from None
        log.info(
            "coordinator %s:%d refused protocol version %d (%s); reconnecting with version %d",
            host, port, version, exc.reason, MIN_PROTOCOL_VERSION,
        )  # fmt: skip
    return await _connect_once(
        host, port, node, token, timeout, max_frame_size, MIN_PROTOCOL_VERSION, secure
    )


def _refused_offer(exc: HandshakeError) -> bool:
    """Whether an older coordinator refused this agent's offer: the previous release refuses
    every version but 1, and a coordinator below version 3 the hello's ``nonce`` as an
    unknown field (it decodes the whole hello before its version)."""
    if exc.by_agent:
        return False
    return exc.code == "version" or (
        exc.code == "bad_field" and exc.reason.startswith("hello: unknown field(s) nonce")
    )


def _unproven(what: str) -> HandshakeError:
    return HandshakeError(
        "unproven_coordinator",
        f"the coordinator {what}: a coordinator below protocol version {MUTUAL_AUTH_VERSION}"
        " cannot prove that it holds the token. Upgrade the coordinators first, connect over"
        " TLS, or (during a rolling upgrade) run the agent with --allow-unproven-coordinator",
        by_agent=True,
    )


def _unsealed(version: int) -> HandshakeError:
    return HandshakeError(
        "unproven_coordinator",
        f"the coordinator answered with protocol version {version}: below"
        f" {FRAME_MAC_VERSION} it does not seal frames, and this agent's answer would be"
        " the older kind, which someone on the path could take to that coordinator to speak"
        " in this node's name. Upgrade the coordinators first, connect over TLS, or (during a"
        " rolling upgrade) run the agent with --allow-unproven-coordinator",
        by_agent=True,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Secure:
    context: ssl.SSLContext | None
    server_hostname: str | None
    allow_unproven: bool = False

    def verifies(self) -> bool:
        """Whether TLS authenticates the coordinator (by its certificate chain and name)."""
        context = self.context
        return (
            context is not None
            and context.verify_mode == ssl.CERT_REQUIRED
            and context.check_hostname
        )

    def may_skip_proof(self) -> bool:
        """Whether a coordinator may skip proving that it holds the token: allowed, or
        authenticated by TLS."""
        return self.allow_unproven or self.verifies()


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
            # a close waits CLOSE_TIMEOUT at most for the coordinator's close_notify (the TLS
            # layer's default, 30 s, held the socket that long after a hung coordinator)
            reader, writer = await asyncio.open_connection(
                host, port, ssl=secure.context,
                server_hostname=(secure.server_hostname or host) if secure.context else None,
                ssl_shutdown_timeout=CLOSE_TIMEOUT if secure.context else None,
            )  # fmt: skip
        conn = Connection(Role.AGENT, token=token, max_frame_size=max_frame_size, version=version)
        link = AgentLink(reader, writer, conn)
        try:
            link.welcome = await _handshake(link, node, timeout, secure)
        except BaseException:
            await link.close()
            raise
        if not link.coordinator_proven and not secure.verifies():
            log.warning(
                "coordinator %s:%d speaks protocol version %d and cannot prove that it holds"
                " the token; accepted because unproven coordinators are allowed (upgrade the"
                " coordinators, then drop --allow-unproven-coordinator)", host, port, link.version,
            )  # fmt: skip
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


async def _handshake(link: AgentLink, node: str, timeout: float, secure: _Secure) -> Welcome:
    link._writer.write(link._conn.hello(node))
    await link._writer.drain()
    try:
        challenge = await link.recv(timeout)
        if not isinstance(challenge, Challenge):
            raise HandshakeError("bad_state", f"expected challenge, got {challenge.TYPE}")
        if challenge.version < MUTUAL_AUTH_VERSION and not secure.may_skip_proof():
            raise _unproven(f"answered with protocol version {challenge.version}")
        if link.version < FRAME_MAC_VERSION <= link._conn.offered and not secure.may_skip_proof():
            raise _unsealed(challenge.version)
        link._writer.write(link._conn.answer(challenge))
        welcome = await link.recv(timeout)
    except LinkClosed as exc:
        if exc.error is not None:
            raise HandshakeError(exc.error.code, exc.error.reason) from None
        raise HandshakeError("closed", str(exc)) from None
    except ProtocolError as exc:  # from this end's checks: the coordinator broke the protocol
        _tell(link, exc.code, exc.reason)
        raise HandshakeError(exc.code, exc.reason, by_agent=True) from None
    except HandshakeError as exc:
        if exc.by_agent:
            _tell(link, exc.code, exc.reason)
        raise
    if not isinstance(welcome, Welcome):
        raise HandshakeError("bad_state", f"expected welcome, got {welcome.TYPE}")
    return welcome


def _tell(link: AgentLink, code: str, reason: str) -> None:
    """Send the coordinator why this agent drops it (so that its log says so); best effort."""
    with contextlib.suppress(ProtocolError, ConnectionError, OSError):
        link._writer.write(link._conn.send_error(code, reason))
