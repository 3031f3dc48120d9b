"""The handshake state machine, driven through an in-memory agent/coordinator pair."""

from __future__ import annotations

import msgpack
import pytest

from flowsched.model import FlowClass
from flowsched.protocol import (
    NEED_DATA,
    PEER_CLOSED,
    PROTOCOL_VERSION,
    TRANSITIONS,
    Auth,
    Challenge,
    Connection,
    Error,
    FlowOpen,
    Flows,
    Heartbeat,
    Hello,
    Levels,
    LevelUpdate,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    Role,
    State,
    Welcome,
    frame,
)

TOKEN = b"k" * 32


class ConnectionPair:
    """An agent and a coordinator Connection wired through an in-memory network."""

    def __init__(
        self,
        agent_token: bytes = TOKEN,
        max_frame_size: int = 1 << 20,
        version: int = PROTOCOL_VERSION,
    ) -> None:
        self.version = version
        self.agent = Connection(
            Role.AGENT, token=agent_token, max_frame_size=max_frame_size, version=version
        )
        self.coordinator = Connection(
            Role.COORDINATOR, token=TOKEN, max_frame_size=max_frame_size, version=version
        )

    def to_coordinator(self, data: bytes) -> Message | object:
        self.coordinator.receive_data(data)
        return self.coordinator.next_event()

    def to_agent(self, data: bytes) -> Message | object:
        self.agent.receive_data(data)
        return self.agent.next_event()

    def handshake(self, node: str = "node-1") -> None:
        hello = self.to_coordinator(self.agent.hello(node))
        assert isinstance(hello, Hello)
        assert (hello.version, hello.node, len(hello.nonce)) == (self.version, node, 32)
        challenge = self.to_agent(self.coordinator.challenge())
        assert isinstance(challenge, Challenge)
        assert isinstance(self.to_coordinator(self.agent.answer(challenge)), Auth)
        welcome = Welcome("", 0.05, 1.0)
        received = self.to_agent(self.coordinator.send(welcome))
        assert received == welcome and isinstance(received, Welcome)
        assert len(received.mac) == 32  # the coordinator's proof (checked by the agent end)


def test_good_token_establishes_both_ends() -> None:
    pair = ConnectionPair()
    pair.handshake()
    assert pair.agent.state is pair.coordinator.state is State.ESTABLISHED
    assert pair.coordinator.node == "node-1"
    assert pair.agent.peer_proven and pair.coordinator.peer_proven
    flows = Flows(opens=(FlowOpen(7, FlowClass.TP, 1.0),))
    assert pair.to_coordinator(pair.agent.send(flows)) == flows
    levels = Levels((LevelUpdate(7, 0),))
    assert pair.to_agent(pair.coordinator.send(levels)) == levels


def _auth_rejected(pair: ConnectionPair, auth_frame: bytes) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        pair.to_coordinator(auth_frame)
    assert pair.coordinator.state is State.ERROR
    return info.value


def test_wrong_token_is_rejected() -> None:
    pair = ConnectionPair(agent_token=b"w" * 32)
    pair.to_coordinator(pair.agent.hello("n"))
    challenge = pair.to_agent(pair.coordinator.challenge())
    assert isinstance(challenge, Challenge)
    error = _auth_rejected(pair, pair.agent.answer(challenge))
    assert error.code == "auth_failed"
    assert "auth.mac" in error.reason


def test_auth_replayed_from_an_earlier_connection_is_rejected() -> None:
    earlier = ConnectionPair()
    earlier.to_coordinator(earlier.agent.hello("n"))
    old_challenge = earlier.to_agent(earlier.coordinator.challenge())
    assert isinstance(old_challenge, Challenge)
    recorded_auth = earlier.agent.answer(old_challenge)  # valid for the earlier nonce only

    later = ConnectionPair()
    later.to_coordinator(frame(msgpack.packb({"t": "hello", "version": 1, "node": "n"})))
    later.coordinator.challenge()  # fresh nonce
    assert _auth_rejected(later, recorded_auth).code == "auth_failed"


def test_unknown_version_is_rejected_naming_the_field() -> None:
    # a hello offers the agent's highest version: only one below every version is refused
    pair = ConnectionPair()
    with pytest.raises(RemoteProtocolError) as info:
        pair.to_coordinator(pair.agent.send(Hello(0, "n")))
    assert info.value.code == "version"
    assert "hello.version: unsupported version 0 (this end speaks 1..5)" in info.value.reason


def test_oversized_frame_is_rejected() -> None:
    pair = ConnectionPair(max_frame_size=64)
    with pytest.raises(RemoteProtocolError) as info:
        pair.to_coordinator((10_000).to_bytes(4, "big") + b"x" * 10)
    assert info.value.code == "frame_too_large"
    assert pair.coordinator.state is State.ERROR


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param({"t": "hello", "version": 1, "node": 5}, "hello.node", id="node-int"),
        pytest.param({"t": "hello", "version": 1.0, "node": "n"}, "hello.version", id="ver-float"),
        pytest.param({"t": "hello", "node": "n"}, "hello.version: missing", id="no-version"),
    ],
)
def test_wrong_field_types_in_hello(body: dict[str, object], field: str) -> None:
    pair = ConnectionPair()
    with pytest.raises(RemoteProtocolError) as info:
        pair.to_coordinator(frame(msgpack.packb(body)))
    assert field in info.value.reason
    assert info.value.code == "bad_field"


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(Flows(), id="flows-before-hello"),
        pytest.param(Heartbeat(1.0), id="heartbeat-before-hello"),
        pytest.param(Auth(b"x" * 32), id="auth-before-challenge"),
    ],
)
def test_messages_before_the_handshake_are_rejected(first: Message) -> None:
    pair = ConnectionPair()
    body = frame(msgpack.packb({"t": first.TYPE, **_fields(first)}, use_bin_type=True))
    with pytest.raises(RemoteProtocolError, match=f"{first.TYPE}: not allowed in state start"):
        pair.to_coordinator(body)


def _fields(message: Message) -> dict[str, object]:
    from flowsched.protocol import encode_body

    decoded: dict[str, object] = msgpack.unpackb(encode_body(message))
    decoded.pop("t")
    return decoded


def test_coordinator_may_not_send_agent_messages() -> None:
    pair = ConnectionPair()
    pair.handshake()
    with pytest.raises(LocalProtocolError, match="cannot send flows"):
        pair.coordinator.send(Flows())
    assert pair.coordinator.state is State.ERROR


def test_error_state_is_sticky_but_may_still_send_an_error_frame() -> None:
    pair = ConnectionPair()
    with pytest.raises(RemoteProtocolError):
        pair.to_coordinator(b"\x00\x00\x00\x01\xc1")
    assert pair.coordinator.state is State.ERROR
    with pytest.raises(RemoteProtocolError, match="ERROR state"):
        pair.coordinator.next_event()
    reply = pair.to_agent(pair.coordinator.send_error("bad_frame", "no"))
    assert reply == Error("bad_frame", "no")
    assert pair.agent.state is State.CLOSED


def test_eof_reported_once_data_is_consumed_and_mid_frame_eof_is_an_error() -> None:
    pair = ConnectionPair()
    pair.coordinator.receive_data(b"")
    assert pair.coordinator.next_event() is PEER_CLOSED
    other = ConnectionPair()
    other.coordinator.receive_data(b"\x00\x00")
    assert other.coordinator.next_event() is NEED_DATA
    other.coordinator.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="mid-frame"):
        other.coordinator.next_event()


def test_transition_table_covers_the_handshake_in_order() -> None:
    order = [
        (Role.AGENT, State.START, "hello"),
        (Role.COORDINATOR, State.HELLO, "challenge"),
        (Role.AGENT, State.CHALLENGED, "auth"),
        (Role.COORDINATOR, State.AUTHENTICATING, "welcome"),
    ]
    state = State.START
    for sender, expected_state, kind in order:
        assert state is expected_state
        state = TRANSITIONS[(sender, state)][kind]
    assert state is State.ESTABLISHED
