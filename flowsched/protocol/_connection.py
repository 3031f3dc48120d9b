"""The sans-IO connection: bytes in, typed messages out, and the reverse.

A :class:`Connection` never touches a socket. The caller feeds it received bytes with
:meth:`Connection.receive_data`, pulls messages with :meth:`Connection.next_event`, and writes
whatever :meth:`Connection.send` returns. It also settles the protocol version of the
connection (:attr:`Connection.version`, see :mod:`flowsched.protocol`) and encodes what it
sends for that version.

From version 3 (:data:`MUTUAL_AUTH_VERSION`) the handshake authenticates both ends: the agent
proves it holds the token by its ``auth`` MAC over the coordinator's nonce, and the
coordinator by its ``welcome`` MAC over the agent's nonce (sent in ``hello``), its own, the
node, both versions and the welcome's content. :attr:`Connection.peer_proven` says whether the
peer has proven it; below version 3 a coordinator never has. From version 5
(:data:`FRAME_MAC_VERSION`) the agent's MAC covers both nonces and both versions too
(:func:`~flowsched.protocol.auth.compute_bound_mac`: a downgrade on the path makes the
coordinator refuse it), and every frame after the handshake is sealed: the agent's after its
``auth``, the coordinator's after its ``welcome`` (:attr:`Connection.sealed`).
"""

from __future__ import annotations

import dataclasses
import hmac
import os
from collections.abc import Callable
from typing import Final

from flowsched.protocol._codec import (
    NONCE_SIZE,
    decode_body,
    encode_body,
    peek_type,
    welcome_digest,
)
from flowsched.protocol._framing import (
    DEFAULT_MAX_FRAME_SIZE,
    HANDSHAKE_MAX_FRAME_SIZE,
    HEADER_SIZE,
    ReceiveBuffer,
    frame,
)
from flowsched.protocol._messages import (
    FRAME_MAC_VERSION,
    MIN_PROTOCOL_VERSION,
    MUTUAL_AUTH_VERSION,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Error,
    Hello,
    Message,
    Welcome,
)
from flowsched.protocol._state import TRANSITIONS, Role, State, next_state
from flowsched.protocol._util import LocalProtocolError, RemoteProtocolError
from flowsched.protocol.auth import (
    AGENT_TO_COORDINATOR,
    COORDINATOR_TO_AGENT,
    FRAME_TAG_SIZE,
    FrameOpener,
    FrameSealer,
    compute_bound_mac,
    compute_mac,
    compute_welcome_mac,
    frame_key,
    verify_welcome_mac,
)


class Sentinel:
    """Type of the NEED_DATA and PEER_CLOSED markers."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: :meth:`Connection.next_event` needs more bytes before it can return a message.
NEED_DATA: Final = Sentinel("NEED_DATA")
#: The peer closed its side (``receive_data(b"")``) and no complete frame is left.
PEER_CLOSED: Final = Sentinel("PEER_CLOSED")

Event = Message | Sentinel


def encode_frame(
    message: Message,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """The whole frame (length prefix and body) of ``message`` for a peer speaking protocol
    ``version``; see :meth:`Connection.send_frame`.

    Raises:
        LocalProtocolError: the body is larger than ``max_frame_size``.
    """
    return frame(encode_body(message, version), max_frame_size)


class Connection:
    """One end of an agent <-> coordinator connection.

    Args:
        role: which end this is.
        token: the shared token. The coordinator end verifies ``auth`` MACs and signs its
            ``welcome`` (version 3 on) with it; the agent end uses it in :meth:`answer` and
            verifies the welcome's MAC. None disables the checks and the signature (tests
            only).
        max_frame_size: largest frame body accepted or sent, in bytes.
        handshake_frame_size: the coordinator end accepts no larger frame body until the
            agent has authenticated (a peer that has not proven it holds the token can make
            this end buffer at most this much).
        nonce_factory: source of the 32-byte nonces: the coordinator's challenge, and the
            agent's in its hello from version 3 (``os.urandom``).
        version: the highest protocol version this end speaks: the coordinator end answers
            a hello with the lower of it and the agent's offer; the agent end offers it
            through :meth:`hello`. ``MIN_PROTOCOL_VERSION`` acts as the previous release.
        min_version: the coordinator end refuses a hello offering less (code ``version``):
            with 5, no session below sealing can open in any node's name, once every agent
            speaks it.

    Attributes:
        version: the connection's protocol version: this end's highest until the handshake
            settles it (the coordinator end on ``hello``, the agent end on ``challenge``).
        peer_proven: whether the peer has proven that it holds the token: the coordinator
            end's agent by a right ``auth`` MAC, the agent end's coordinator by a right
            ``welcome`` MAC (version 3 on: below it a coordinator cannot, and this stays
            False). Always False without a token.
        sealed: whether the frames after the handshake carry MACs (version 5 on, with a
            token): set once this end's side of the handshake is done (the agent's ``auth``
            sent, the coordinator's ``welcome`` sent).
    """

    def __init__(
        self,
        role: Role,
        *,
        token: bytes | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        handshake_frame_size: int = HANDSHAKE_MAX_FRAME_SIZE,
        nonce_factory: Callable[[int], bytes] = os.urandom,
        version: int = PROTOCOL_VERSION,
        min_version: int = MIN_PROTOCOL_VERSION,
    ) -> None:
        if not MIN_PROTOCOL_VERSION <= version <= PROTOCOL_VERSION:
            raise ValueError(
                f"version {version}: this implementation speaks"
                f" {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}"
            )
        if not MIN_PROTOCOL_VERSION <= min_version <= version:
            raise ValueError(
                f"min_version {min_version}: expected {MIN_PROTOCOL_VERSION}..{version}"
            )
        self._min_version = min_version
        self.role = role
        self.version = version
        self._offered = version
        self.state = State.START
        self.node: str | None = None
        self._peer = Role.AGENT if role is Role.COORDINATOR else Role.COORDINATOR
        self._token = token
        self._max_frame_size = max_frame_size
        self._nonce_factory = nonce_factory
        self._nonce: bytes | None = None  # the coordinator's (challenge)
        self._agent_nonce = b""  # the agent's (hello, version 3 on)
        self.peer_proven = False
        self.sealed = False
        self._sealer: FrameSealer | None = None  # what this end sends, once sealed
        self._opener: FrameOpener | None = None  # what the peer sends, once sealed
        receive_limit = max_frame_size
        if role is Role.COORDINATOR:  # the agent end's peer (the coordinator) sends the policy
            receive_limit = min(handshake_frame_size, max_frame_size)
        self._buffer = ReceiveBuffer(receive_limit)
        self._eof = False
        #: message types the peer may send once established (none change the state)
        self._established = frozenset(TRANSITIONS[(self._peer, State.ESTABLISHED)])

    @property
    def offered(self) -> int:
        """The version the agent offered in its ``hello`` (sent by this end, or received)."""
        return self._offered

    # -- sending -----------------------------------------------------------------------------

    def send(self, message: Message) -> bytes:
        """Return the frame for ``message`` and advance the state.

        Raises:
            LocalProtocolError: the message is not legal now (the connection enters ``ERROR``),
                or it does not fit in one frame.
        """
        new_state = next_state(self.role, self.state, message.TYPE)
        if new_state is None:
            reason = f"cannot send {message.TYPE} in state {self.state.value} as {self.role.value}"
            self.state = State.ERROR
            raise LocalProtocolError(reason, code="bad_state")
        if isinstance(message, Welcome) and self.role is Role.COORDINATOR:
            message = self._signed(message)
        data = self._framed(encode_body(message, self.version))
        self._note_sent(message)
        self.state = new_state
        if new_state is State.ESTABLISHED:  # the peer is authenticated: full-size frames
            self._buffer.max_frame_size = self._receive_limit()
        if isinstance(message, Auth | Welcome):  # this end's last handshake frame
            self._seal_what_follows()
        return data

    def _framed(self, body: bytes) -> bytes:
        """The frame of ``body``: sealed once this end's side of the handshake is done (a body
        over the limit is refused before the sequence number moves)."""
        if self._sealer is None or len(body) > self._max_frame_size:
            return frame(body, self._max_frame_size)
        return frame(self._sealer.seal(body), self._max_frame_size + FRAME_TAG_SIZE)

    def _receive_limit(self) -> int:
        return self._max_frame_size + (FRAME_TAG_SIZE if self._opener is not None else 0)

    def _frame_key(self, direction: bytes) -> bytes:
        assert self._token is not None and self._nonce is not None and self.node is not None
        return frame_key(
            self._token, direction, agent_nonce=self._agent_nonce, coordinator_nonce=self._nonce,
            node=self.node,
        )  # fmt: skip

    def _seal_what_follows(self) -> None:
        """From version 5, with a token: seal every frame this end sends from now on."""
        if self.version < FRAME_MAC_VERSION or self._token is None:
            return
        mine = AGENT_TO_COORDINATOR if self.role is Role.AGENT else COORDINATOR_TO_AGENT
        self._sealer = FrameSealer(self._frame_key(mine))
        self.sealed = True

    def _open_what_follows(self) -> None:
        """From version 5, once the peer proved it holds the token: every frame it sends
        from now on must carry its MAC."""
        if self.version < FRAME_MAC_VERSION or self._token is None:
            return
        theirs = COORDINATOR_TO_AGENT if self.role is Role.AGENT else AGENT_TO_COORDINATOR
        self._opener = FrameOpener(self._frame_key(theirs))
        if self._buffer.max_frame_size == self._max_frame_size:  # else raised at the welcome
            self._buffer.max_frame_size = self._receive_limit()

    def send_frame(self, kind: str, data: bytes) -> bytes:
        """Return ``data``, a frame already encoded (e.g. by :func:`encode_frame`) for a
        message of type ``kind``, after the same state check as :meth:`send`. For messages
        sent to many peers at once (heartbeats): encoded once, not once per connection.
        Handshake messages, which change what the connection remembers, go through
        :meth:`send`.
        """
        new_state = next_state(self.role, self.state, kind)
        if new_state is not self.state or self.state is not State.ESTABLISHED:
            reason = f"cannot send {kind} as a pre-encoded frame in state {self.state.value}"
            self.state = State.ERROR
            raise LocalProtocolError(reason, code="bad_state")
        if self._sealer is None:
            return data
        return self._framed(data[HEADER_SIZE:])  # its own MAC on each connection

    def _note_sent(self, message: Message) -> None:
        if isinstance(message, Hello):
            self.node = message.node
            self._offered = message.version  # what the challenge may answer with, at most
            self._agent_nonce = message.nonce
        elif isinstance(message, Challenge):
            self._nonce = message.nonce

    def _signed(self, welcome: Welcome) -> Welcome:
        """The coordinator's ``welcome`` with its MAC, from version 3 (unsigned below it, or
        without a token)."""
        if self.version < MUTUAL_AUTH_VERSION or self._token is None:
            return dataclasses.replace(welcome, mac=b"")
        return dataclasses.replace(welcome, mac=self._welcome_mac(welcome))

    def _welcome_mac(self, welcome: Welcome) -> bytes:
        assert self._token is not None and self._nonce is not None and self.node is not None
        return compute_welcome_mac(
            self._token, agent_nonce=self._agent_nonce, coordinator_nonce=self._nonce,
            node=self.node, offered=self._offered, version=self.version,
            digest=welcome_digest(welcome),
        )  # fmt: skip

    def hello(self, node: str) -> bytes:
        """Agent: send the ``hello`` of agent ``node``, offering this end's version (from
        version 3 with a fresh nonce, which the coordinator's welcome MAC must cover)."""
        nonce = b""
        if self.version >= MUTUAL_AUTH_VERSION:
            nonce = self._nonce_factory(NONCE_SIZE)
        return self.send(Hello(self.version, node, nonce))

    def challenge(self) -> bytes:
        """Coordinator: send a challenge with a fresh nonce (after receiving ``hello``)."""
        return self.send(Challenge(self.version, self._nonce_factory(NONCE_SIZE)))

    def answer(self, challenge: Challenge) -> bytes:
        """Agent: send the ``auth`` frame answering ``challenge`` with this end's token (from
        version 5 bound to both nonces and both versions: :func:`compute_bound_mac`)."""
        if self._token is None or self.node is None:
            raise LocalProtocolError("answer() needs a token and a sent hello", code="bad_state")
        return self.send(Auth(self._auth_mac(challenge.nonce)))

    def _auth_mac(self, coordinator_nonce: bytes) -> bytes:
        assert self._token is not None and self.node is not None
        if self.version < FRAME_MAC_VERSION:
            return compute_mac(self._token, coordinator_nonce, self.node)
        return compute_bound_mac(
            self._token, agent_nonce=self._agent_nonce, coordinator_nonce=coordinator_nonce,
            node=self.node, offered=self._offered, version=self.version,
        )  # fmt: skip

    def send_error(self, code: str, reason: str) -> bytes:
        """Return an ``error`` frame (legal in every state, ``ERROR`` included)."""
        return self.send(Error(code[:255], reason[:4096]))

    # -- receiving ---------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes received from the peer (copied: a view may be reused afterwards);
        ``b""`` means the peer closed its side."""
        if data:
            self._buffer.feed(data)
        else:
            self._eof = True

    def next_event(self) -> Event:
        """The next message from the peer, :data:`NEED_DATA` or :data:`PEER_CLOSED`.

        Raises:
            RemoteProtocolError: the peer broke the protocol (bad frame, bad field, illegal
                message for the state, unknown version, wrong MAC). The connection enters
                ``ERROR``; ``code`` and ``reason`` say why and may be sent back with
                :meth:`send_error`.
        """
        if self.state is State.ERROR:
            raise RemoteProtocolError("connection is in the ERROR state", code="bad_state")
        try:
            return self._next_event()
        except LocalProtocolError as exc:
            self.state = State.ERROR
            error = exc._reraise_as_remote()
        # raised outside the handler, so that the error does not carry the decoder's exception
        # as its context: that one's traceback holds the decoder's frames, and with them
        # everything the frame decoded into (a million objects from one 1 MiB frame)
        raise error

    def _next_event(self) -> Event:
        body = self._buffer.next_body()
        if body is None:
            if self._eof:
                if len(self._buffer):
                    raise LocalProtocolError("peer closed mid-frame", code="bad_frame")
                return PEER_CLOSED
            return NEED_DATA
        if self._opener is not None:
            body = self.opened(body)
        if self.state is State.ESTABLISHED:
            # the hot path: no handshake checks, the peer's legal types looked up directly
            message = decode_body(body)
            if message.TYPE in self._established:
                return message
            if message.TYPE != "error":
                raise LocalProtocolError(
                    f"{message.TYPE}: not allowed in state established", code="bad_state"
                )
            self.state = State.CLOSED
            return message
        self._check_type_before_decoding(body)
        message = decode_body(body)
        new_state = next_state(self._peer, self.state, message.TYPE)
        if new_state is None:
            raise LocalProtocolError(
                f"{message.TYPE}: not allowed in state {self.state.value}", code="bad_state"
            )
        self._check_handshake(message)
        self.state = new_state
        return message

    @property
    def receive_buffer(self) -> ReceiveBuffer:
        """The buffer :meth:`receive_data` feeds, with whatever it holds (a frame cut short
        included), for callers that go on cutting frames themselves after the handshake and
        open them with :meth:`opened` (the benchmarks' simulated agents)."""
        return self._buffer

    def opened(self, sealed: bytes) -> bytes:
        """The body of a frame received once the peer's frames are sealed, its MAC checked
        and taken off (as is before that). For callers that cut frames themselves (the
        benchmarks' simulated agents); :meth:`next_event` does this for its own frames.

        Raises:
            LocalProtocolError: code ``bad_mac``, the MAC is wrong or missing.
        """
        if self._opener is None:
            return sealed
        try:
            return self._opener.open(sealed)
        except ValueError as exc:
            raise LocalProtocolError(
                f"frame MAC: {exc}: the frame was altered, injected, dropped or replayed on the"
                " way (or the peer does not hold the token)",
                code="bad_mac",
            ) from None

    def _check_type_before_decoding(self, body: bytes) -> None:
        """During the handshake only a few small frames are legal: refuse anything else from
        its type alone, so that an unauthenticated peer never gets a frame decoded and
        validated (a well-formed 1 MiB ``flows`` frame costs milliseconds to decode)."""
        kind = peek_type(body)
        if kind == "error" or kind in TRANSITIONS.get((self._peer, self.state), {}):
            return
        what = kind if kind is not None else "frame (type unreadable)"
        raise LocalProtocolError(
            f"{what}: not allowed in state {self.state.value} (refused before decoding)",
            code="bad_state",
        )

    def _check_handshake(self, message: Message) -> None:
        if isinstance(message, Hello | Challenge):
            self._settle_version(message)
        if isinstance(message, Hello):
            self._received_hello(message)
        elif isinstance(message, Challenge):
            self._nonce = message.nonce
        elif isinstance(message, Auth):
            self._check_mac(message.mac)
        elif isinstance(message, Welcome):
            self._check_welcome(message)

    def _received_hello(self, hello: Hello) -> None:
        self.node = hello.node
        self._offered = hello.version  # covered by the welcome MAC (a downgrade shows)
        self._agent_nonce = hello.nonce
        if self.version >= MUTUAL_AUTH_VERSION and not hello.nonce:
            raise LocalProtocolError(
                f"hello.nonce: missing (an agent offering version {hello.version} sends one)",
                code="bad_field",
            )

    def _settle_version(self, message: Hello | Challenge) -> None:
        """Version negotiation: a hello offers the agent's highest version, and the
        coordinator answers (challenge) with the highest both speak. An agent of the previous
        release offers 1 and gets 1; the coordinator of the previous release refuses every
        offer but 1 (code ``version``), and the agent then reconnects offering 1
        (:func:`flowsched.protocol.aio.connect_agent`)."""
        offered = message.version
        if isinstance(message, Hello):
            if offered >= self._min_version:
                self.version = min(offered, self._offered)
                return
        elif MIN_PROTOCOL_VERSION <= offered <= self._offered:  # never above what we offered
            self.version = offered
            return
        raise LocalProtocolError(
            f"{message.TYPE}.version: unsupported version {offered}"
            f" (this end speaks {self._min_version}..{self._offered})",
            code="version",
        )

    def _check_mac(self, mac: bytes) -> None:
        if self._token is None:
            return
        assert self._nonce is not None and self.node is not None  # guaranteed by the table
        if not hmac.compare_digest(self._auth_mac(self._nonce), mac):
            raise LocalProtocolError(
                f"auth.mac: wrong MAC for node {self.node!r} (bad token or replayed auth)",
                code="auth_failed",
            )
        self.peer_proven = True
        self._open_what_follows()

    def _check_welcome(self, welcome: Welcome) -> None:
        """Agent end, version 3 on: the coordinator must prove it holds the token."""
        if self.version < MUTUAL_AUTH_VERSION or self._token is None:
            return
        if not welcome.mac:
            raise LocalProtocolError(
                f"welcome.mac: missing at protocol version {self.version}: the coordinator did"
                " not prove that it holds the token",
                code="auth_failed",
            )
        assert self._nonce is not None and self.node is not None  # guaranteed by the table
        if not verify_welcome_mac(
            self._token, welcome.mac, agent_nonce=self._agent_nonce,
            coordinator_nonce=self._nonce, node=self.node, offered=self._offered,
            version=self.version, digest=welcome_digest(welcome),
        ):  # fmt: skip
            raise LocalProtocolError(
                "welcome.mac: wrong MAC: the coordinator does not hold this agent's token, or"
                " the welcome was altered on the way",
                code="auth_failed",
            )
        self.peer_proven = True
        self._open_what_follows()
