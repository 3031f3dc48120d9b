"""Before authentication: a small frame limit and the state checked before any decoding."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from protocol_strategies import messages
from test_protocol_handshake import TOKEN, ConnectionPair

import flowsched.protocol._connection as connection_module
from flowsched.model import FlowClass
from flowsched.protocol import (
    HANDSHAKE_MAX_FRAME_SIZE,
    NEED_DATA,
    Connection,
    FlowOpen,
    Flows,
    Message,
    RemoteProtocolError,
    Role,
    State,
    Welcome,
    decode_body,
    encode_body,
    frame,
    peek_type,
)
from flowsched.protocol._codec import MAX_MAP

MIB = 1 << 20


def _flows_frame(size: int) -> bytes:
    """A well-formed ``flows`` frame of about ``size`` bytes."""
    one = FlowOpen(0, FlowClass.BULK, 1.0, job="j" * 200, links=("a:tx",))
    count = max(size // len(encode_body(Flows(opens=(one,)))), 1)
    body = encode_body(Flows(opens=tuple(FlowOpen(i, **_fields(one)) for i in range(count))))
    return frame(body, 2 * MIB)


def _fields(open_: FlowOpen) -> dict[str, object]:
    return {k: getattr(open_, k) for k in ("cls", "opened_at", "job", "links")}


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The type of every frame the Connection decodes (the full msgpack decode + checks)."""
    seen: list[str] = []

    def counting(body: bytes) -> Message:
        message = decode_body(body)
        seen.append(message.TYPE)
        return message

    monkeypatch.setattr(connection_module, "decode_body", counting)
    return seen


def test_an_unauthenticated_first_frame_over_the_limit_is_refused_from_its_header() -> None:
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    coordinator.receive_data(MIB.to_bytes(4, "big") + b"\x00" * 1000)  # half-sent 1 MiB frame
    with pytest.raises(RemoteProtocolError, match=f"allowed 1..{HANDSHAKE_MAX_FRAME_SIZE}") as exc:
        coordinator.next_event()
    assert exc.value.code == "frame_too_large"
    assert coordinator.state is State.ERROR


def test_the_limit_is_small_before_auth_and_full_size_after() -> None:
    pair = ConnectionPair()
    big = _flows_frame(HANDSHAKE_MAX_FRAME_SIZE + 1000)
    pair.handshake()
    sealed = pair.agent.send_frame("flows", big)  # established: the full 1 MiB limit
    assert isinstance(pair.to_coordinator(sealed), Flows)
    sealed = pair.agent.send_frame("flows", _flows_frame(MIB - 64 * 1024))
    assert isinstance(pair.to_coordinator(sealed), Flows)


def test_the_agent_end_takes_a_welcome_larger_than_the_handshake_limit() -> None:
    pair = ConnectionPair()
    pair.to_coordinator(pair.agent.hello("n1"))
    challenge = pair.to_agent(pair.coordinator.challenge())
    pair.to_coordinator(pair.agent.answer(challenge))  # type: ignore[arg-type]
    welcome = Welcome("# policy\n" * 20_000, 0.05, 1.0)  # a 180 KB policy file
    assert pair.to_agent(pair.coordinator.send(welcome)) == welcome


@pytest.mark.parametrize("state", ["start", "after-hello", "after-challenge"])
def test_a_well_formed_flows_frame_before_auth_is_refused_without_decoding(
    state: str, decodes: list[str]
) -> None:
    pair = ConnectionPair()
    if state != "start":
        pair.to_coordinator(pair.agent.hello("n1"))
    if state == "after-challenge":
        pair.coordinator.challenge()
    before = list(decodes)
    with pytest.raises(
        RemoteProtocolError, match=r"flows: not allowed .*\(refused before decoding\)"
    ):
        pair.to_coordinator(_flows_frame(3000))
    assert decodes == before, "a non-handshake frame was decoded before authentication"


def test_a_frame_whose_type_cannot_be_peeked_is_refused_before_decoding(
    decodes: list[str],
) -> None:
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    body = msgpack.packb({"opens": [1, 2, 3], "t": "hello"})  # a container before "t"
    coordinator.receive_data(frame(body))
    with pytest.raises(RemoteProtocolError, match="type unreadable"):
        coordinator.next_event()
    assert decodes == []


def test_handshake_frames_are_still_decoded_and_checked(decodes: list[str]) -> None:
    pair = ConnectionPair()
    pair.handshake()
    assert decodes == ["hello", "challenge", "auth", "welcome"]  # both ends, in order
    assert pair.coordinator.next_event() is NEED_DATA


@given(messages)
def test_peek_type_names_every_encoded_message(message: Message) -> None:
    assert peek_type(encode_body(message)) == message.TYPE


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (msgpack.packb({"version": 1, "node": "n", "t": "hello"}), "hello"),  # "t" last
        (msgpack.packb({"mac": b"x" * 32, "t": "auth"}, use_bin_type=True), "auth"),
        (msgpack.packb({"x": 1.5, "y": None, "z": True, "t": "auth"}), "auth"),
        (msgpack.packb({"x": [1], "t": "auth"}), None),  # container first: not peeked
        (msgpack.packb({"t": 7}), None),
        (msgpack.packb([1, 2]), None),
        (b"", None),
        (b"\x81\xa1t", None),  # truncated
        (b"\xdf\xff\xff\xff\xff", None),  # map32 announcing 4 G entries, nothing after
    ],
)
def test_peek_type_reads_scalars_only(body: bytes, expected: str | None) -> None:
    assert peek_type(body) == expected


@pytest.mark.parametrize(("keys_before", "expected"), [(MAX_MAP - 1, "hello"), (MAX_MAP, None)])
def test_peek_type_reads_no_more_keys_than_a_frame_has(
    keys_before: int, expected: str | None
) -> None:
    """A map header may claim 4 G entries: the peek stops where a legal frame would end, so a
    refused frame costs the same whatever its header claims (it walked every key before)."""
    pairs = b"".join(msgpack.packb(f"k{i}") + msgpack.packb(i) for i in range(keys_before))
    body = b"\xdf\xff\xff\xff\xff" + pairs + msgpack.packb("t") + msgpack.packb("hello")
    assert peek_type(body) == expected


@given(st.binary(max_size=64))
def test_peek_type_never_raises_on_garbage(body: bytes) -> None:
    assert peek_type(body) is None or isinstance(peek_type(body), str)
