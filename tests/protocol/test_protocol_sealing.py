"""Frames after the handshake carry MACs from protocol version 5: what someone on the path
can no longer do (alter, inject, drop, replay, reorder, reflect, move a frame to another
connection), what stays as it was below version 5, and the keys' derivation."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_protocol_handshake import TOKEN, ConnectionPair

from flowsched.protocol import (
    FRAME_MAC_VERSION,
    Auth,
    Connection,
    Flows,
    Heartbeat,
    Levels,
    LevelUpdate,
    LocalProtocolError,
    RemoteProtocolError,
    Role,
    Welcome,
    encode_body,
    encode_frame,
)
from flowsched.protocol._framing import HEADER_SIZE
from flowsched.protocol.auth import (
    AGENT_TO_COORDINATOR,
    COORDINATOR_TO_AGENT,
    FRAME_TAG_SIZE,
    FrameOpener,
    FrameSealer,
    frame_key,
)

UNSEALED = FRAME_MAC_VERSION - 1
PROGRESS = Flows(progress_ids=(1, 2), progress_sent=(10, 20))
LEVELS = Levels((LevelUpdate(1, 3),))


def established(version: int = FRAME_MAC_VERSION) -> ConnectionPair:
    pair = ConnectionPair(version=version)
    pair.handshake()
    return pair


def refused(deliver: object, data: bytes) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        deliver(data)  # type: ignore[operator]
    return info.value


def test_both_ends_seal_from_version_5_and_not_below() -> None:
    sealed, plain = established(), established(UNSEALED)
    assert sealed.agent.sealed and sealed.coordinator.sealed
    assert not plain.agent.sealed and not plain.coordinator.sealed
    for pair, extra in ((sealed, FRAME_TAG_SIZE), (plain, 0)):
        up, down = pair.agent.send(PROGRESS), pair.coordinator.send(LEVELS)
        assert len(up) == len(encode_frame(PROGRESS, version=pair.version)) + extra
        assert len(down) == len(encode_frame(LEVELS, version=pair.version)) + extra
        assert pair.to_coordinator(up) == PROGRESS and pair.to_agent(down) == LEVELS


@given(position=st.integers(min_value=HEADER_SIZE), bit=st.integers(0, 7))
def test_any_bit_flipped_in_a_sealed_frame_is_refused(position: int, bit: int) -> None:
    pair = established()
    data = bytearray(pair.agent.send(PROGRESS))
    data[HEADER_SIZE + (position - HEADER_SIZE) % (len(data) - HEADER_SIZE)] ^= 1 << bit
    assert refused(pair.to_coordinator, bytes(data)).code == "bad_mac"


@pytest.mark.parametrize("direction", ["to-coordinator", "to-agent"])
def test_an_injected_unsealed_frame_is_refused(direction: str) -> None:
    pair = established()
    if direction == "to-coordinator":
        error = refused(pair.to_coordinator, encode_frame(Heartbeat(1.0)))
    else:
        error = refused(pair.to_agent, encode_frame(LEVELS))
    assert error.code == "bad_mac" and "altered, injected, dropped or replayed" in error.reason


@pytest.mark.parametrize("case", ["replayed", "dropped", "reordered"])
def test_a_frame_replayed_dropped_or_reordered_is_refused(case: str) -> None:
    pair = established()
    first, second = pair.agent.send(PROGRESS), pair.agent.send(Heartbeat(2.0))
    if case == "replayed":
        assert pair.to_coordinator(first) == PROGRESS
        next_frame = first
    elif case == "dropped":
        next_frame = second
    else:
        next_frame = second + first
    assert refused(pair.to_coordinator, next_frame).code == "bad_mac"


def test_a_frame_reflected_back_to_its_sender_is_refused() -> None:
    pair = established()
    levels = pair.coordinator.send(LEVELS)  # sealed under the coordinator -> agent key
    assert refused(pair.to_coordinator, levels).code == "bad_mac"


def test_a_frame_moved_to_another_connection_of_the_same_node_is_refused() -> None:
    """Each connection's keys come from its own fresh nonces: a frame recorded on one
    connection means nothing on the next, even at the same position."""
    recorded, later = established(), established()
    assert refused(later.to_coordinator, recorded.agent.send(PROGRESS)).code == "bad_mac"


def test_a_pre_encoded_frame_is_sealed_for_each_connection() -> None:
    """The coordinator encodes a heartbeat once for every agent; each connection seals it
    under its own key and sequence number."""
    beat = encode_frame(Heartbeat(5.0))
    pairs = [established(), established()]
    sent = [pair.coordinator.send_frame(Heartbeat.TYPE, beat) for pair in pairs]
    assert sent[0] != sent[1] and all(len(s) == len(beat) + FRAME_TAG_SIZE for s in sent)
    assert all(pair.to_agent(s) == Heartbeat(5.0) for pair, s in zip(pairs, sent, strict=True))
    plain = established(UNSEALED)
    assert plain.coordinator.send_frame(Heartbeat.TYPE, beat) == beat


def _progress(count: int) -> Flows:
    return Flows(progress_ids=tuple(range(count)), progress_sent=(0,) * count)


def test_the_largest_body_still_fits_with_its_mac() -> None:
    """The frame size limit is on the body: a sealed frame may be a MAC longer on the wire."""
    limit = 4096
    pair = ConnectionPair(max_frame_size=limit)
    pair.handshake()
    count = max(n for n in range(1, limit) if len(encode_body(_progress(n))) <= limit)
    largest = pair.agent.send(_progress(count))
    assert len(largest) > HEADER_SIZE + limit  # the MAC on top of a body near the limit
    assert pair.to_coordinator(largest) == _progress(count)
    with pytest.raises(LocalProtocolError) as info:
        pair.agent.send(_progress(count + 1))
    assert info.value.code == "frame_too_large"
    # the refused frame took no sequence number: the next one still opens
    assert pair.to_coordinator(pair.agent.send(PROGRESS)) == PROGRESS


def test_what_the_agent_sends_after_its_auth_is_sealed_before_the_welcome() -> None:
    """The agent seals from its auth on (frames it pipelines before the welcome included);
    the coordinator opens from that auth on and seals from its welcome on."""
    pair = ConnectionPair()
    pair.to_coordinator(pair.agent.hello("n1"))
    challenge = pair.to_agent(pair.coordinator.challenge())
    pair.to_coordinator(pair.agent.answer(challenge))  # type: ignore[arg-type]
    assert pair.agent.sealed and not pair.coordinator.sealed
    pair.coordinator.send(Welcome("", 0.05, 1.0))
    assert pair.coordinator.sealed


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("direction", b"AC", "direction: expected 1 byte, got 2"),
        ("agent_nonce", b"x" * 31, "agent_nonce: expected 32 bytes, got 31"),
        ("coordinator_nonce", b"", "coordinator_nonce: expected 32 bytes, got 0"),
    ],
)
def test_frame_keys_refuse_malformed_inputs(field: str, value: bytes, message: str) -> None:
    args: dict[str, bytes] = {
        "direction": AGENT_TO_COORDINATOR,
        "agent_nonce": b"a" * 32,
        "coordinator_nonce": b"c" * 32,
    }
    args[field] = value
    direction = args.pop("direction")
    with pytest.raises(ValueError, match=message):
        frame_key(TOKEN, direction, node="n1", **args)


def test_frame_keys_differ_by_direction_nonce_node_and_token() -> None:
    def key(**changes: object) -> bytes:
        args: dict[str, object] = {
            "token": TOKEN,
            "direction": AGENT_TO_COORDINATOR,
            "agent_nonce": b"a" * 32,
            "coordinator_nonce": b"c" * 32,
            "node": "n1",
        }
        args.update(changes)
        token, direction = args.pop("token"), args.pop("direction")
        return frame_key(token, direction, **args)  # type: ignore[arg-type]

    variants = [
        key(),
        key(direction=COORDINATOR_TO_AGENT),
        key(agent_nonce=b"b" * 32),
        key(coordinator_nonce=b"d" * 32),
        key(node="n2"),
        key(token=b"t" * 32),
    ]
    assert len(set(variants)) == len(variants)


def test_an_opener_refuses_a_body_too_short_for_a_mac() -> None:
    opener = FrameOpener(b"k" * 32)
    with pytest.raises(ValueError, match="too short"):
        opener.open(b"x" * FRAME_TAG_SIZE)
    sealer = FrameSealer(b"k" * 32)
    assert FrameOpener(b"k" * 32).open(sealer.seal(b"body")) == b"body"


def test_the_wire_format_of_a_sealed_frame_and_of_a_version_5_auth() -> None:
    """The formats docs/protocol.md gives, computed here with hashlib and hmac alone."""
    agent = Connection(Role.AGENT, token=TOKEN, nonce_factory=lambda n: b"a" * n)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN, nonce_factory=lambda n: b"c" * n)
    coordinator.receive_data(agent.hello("n1"))
    coordinator.next_event()
    agent.receive_data(coordinator.challenge())
    challenge = agent.next_event()
    auth = agent.answer(challenge)  # type: ignore[arg-type]
    label = b"flowsched/auth" + b"a" * 32 + b"c" * 32 + b"\x00\x05\x00\x05" + b"n1"
    assert auth == encode_frame(Auth(hmac.new(TOKEN, label, hashlib.sha256).digest()))
    coordinator.receive_data(auth)
    coordinator.next_event()
    agent.receive_data(coordinator.send(Welcome("", 0.05, 1.0)))
    agent.next_event()
    first = agent.send(PROGRESS)
    key_input = b"flowsched/frames" + b"A" + b"a" * 32 + b"c" * 32 + b"n1"
    key = hmac.new(TOKEN, key_input, hashlib.sha256).digest()
    body = encode_body(PROGRESS)
    tag = hashlib.blake2b(bytes(8) + body, key=key, digest_size=16).digest()
    assert first == len(body + tag).to_bytes(4, "big") + body + tag


def test_a_coordinator_with_a_minimum_version_refuses_older_hellos() -> None:
    coordinator = Connection(Role.COORDINATOR, token=TOKEN, min_version=FRAME_MAC_VERSION)
    agent = Connection(Role.AGENT, token=TOKEN, version=UNSEALED)
    with pytest.raises(RemoteProtocolError) as info:
        coordinator.receive_data(agent.hello("n1"))
        coordinator.next_event()
    assert info.value.code == "version"
    assert "unsupported version 4 (this end speaks 5..5)" in info.value.reason
    with pytest.raises(ValueError, match=r"min_version 5: expected 1\.\.4"):
        Connection(Role.COORDINATOR, version=UNSEALED, min_version=FRAME_MAC_VERSION)
