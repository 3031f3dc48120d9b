"""Protocol version negotiation and the form of progress each version sends."""

from __future__ import annotations

import msgpack
import pytest

from flowsched.protocol import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Connection,
    FlowClose,
    Flows,
    Hello,
    RemoteProtocolError,
    Role,
    State,
    Welcome,
    decode_body,
    frame,
)

TOKEN = b"k" * 32


def _handshake(agent: Connection, coordinator: Connection, offer: int | None = None) -> None:
    """Run the handshake between two in-memory ends (the agent offering ``offer``, by default
    its own version)."""
    hello = agent.hello("n1") if offer is None else agent.send(Hello(offer, "n1", b"a" * 32))
    coordinator.receive_data(hello)
    assert isinstance(coordinator.next_event(), Hello)
    agent.receive_data(coordinator.challenge())
    challenge = agent.next_event()
    assert isinstance(challenge, Challenge)
    coordinator.receive_data(agent.answer(challenge))
    assert isinstance(coordinator.next_event(), Auth)
    agent.receive_data(coordinator.send(Welcome("", 0.05, 1.0)))
    assert isinstance(agent.next_event(), Welcome)
    assert agent.state is coordinator.state is State.ESTABLISHED


@pytest.mark.parametrize(
    ("agent_speaks", "coordinator_speaks", "agreed"),
    [
        pytest.param(3, 3, 3, id="both-new"),
        pytest.param(2, 3, 2, id="v2-agent-new-coordinator"),
        pytest.param(1, 3, 1, id="old-agent-new-coordinator"),
        pytest.param(3, 2, 2, id="new-agent-coordinator-held-at-2"),
        pytest.param(2, 2, 2, id="both-at-2"),
        pytest.param(2, 1, 1, id="v2-agent-coordinator-held-at-1"),
        pytest.param(3, 1, 1, id="new-agent-coordinator-held-at-1"),
        pytest.param(1, 1, 1, id="both-at-1"),
    ],
)
def test_the_connection_uses_the_highest_version_both_ends_speak(
    agent_speaks: int, coordinator_speaks: int, agreed: int
) -> None:
    agent = Connection(Role.AGENT, token=TOKEN, version=agent_speaks)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN, version=coordinator_speaks)
    _handshake(agent, coordinator)
    assert agent.version == coordinator.version == agreed


def test_an_agent_offering_a_future_version_gets_the_coordinators() -> None:
    agent = Connection(Role.AGENT, token=TOKEN)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    _handshake(agent, coordinator, offer=PROTOCOL_VERSION + 5)
    assert coordinator.version == PROTOCOL_VERSION


@pytest.mark.parametrize(
    "answer", [0, PROTOCOL_VERSION + 1], ids=["below-every-version", "above-the-offer"]
)
def test_the_agent_refuses_a_challenge_outside_what_it_offered(answer: int) -> None:
    agent = Connection(Role.AGENT, token=TOKEN)
    agent.hello("n1")
    agent.receive_data(
        frame(msgpack.packb({"t": "challenge", "version": answer, "nonce": b"x" * 32}))
    )
    with pytest.raises(RemoteProtocolError) as info:
        agent.next_event()
    assert info.value.code == "version"
    speaks = f"(this end speaks 1..{PROTOCOL_VERSION})"
    assert f"challenge.version: unsupported version {answer} {speaks}" in str(info.value)


def test_a_connection_refuses_to_speak_a_version_it_does_not_know() -> None:
    with pytest.raises(ValueError, match=f"version {PROTOCOL_VERSION + 1}"):
        Connection(Role.AGENT, version=PROTOCOL_VERSION + 1)
    with pytest.raises(ValueError, match="version 0"):
        Connection(Role.COORDINATOR, version=MIN_PROTOCOL_VERSION - 1)


BATCH = Flows(
    progress_ids=(1, 2, 2**64 - 1),
    progress_sent=(0, 655360, 7),
    closes=(FlowClose(9, 10, 1.5),),
)


@pytest.mark.parametrize(
    ("agent_speaks", "keys"),
    [
        pytest.param(3, {"t", "opens", "progress_ids", "progress_sent", "closes"}, id="v3-packed"),
        pytest.param(2, {"t", "opens", "progress_ids", "progress_sent", "closes"}, id="v2-packed"),
        pytest.param(1, {"t", "opens", "progress", "closes"}, id="v1-maps"),
    ],
)
def test_flows_go_on_the_wire_in_the_form_of_the_agreed_version(
    agent_speaks: int, keys: set[str]
) -> None:
    agent = Connection(Role.AGENT, token=TOKEN, version=agent_speaks)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    _handshake(agent, coordinator)
    data = agent.send(BATCH)
    body = msgpack.unpackb(data[4:])
    assert set(body) == keys
    if agent_speaks == 1:  # what a coordinator of the previous release decodes
        assert body["progress"] == [{"id": 1, "sent": 0}, {"id": 2, "sent": 655360},
                                    {"id": 2**64 - 1, "sent": 7}]  # fmt: skip
    else:
        assert (body["progress_ids"], body["progress_sent"]) == ([1, 2, 2**64 - 1], [0, 655360, 7])
    coordinator.receive_data(data)
    assert coordinator.next_event() == BATCH
    assert decode_body(data[4:]) == BATCH


def test_a_coordinator_decodes_both_forms_whatever_the_agreed_version() -> None:
    # an agent that agreed on version 1 but sends arrays anyway is still understood: the
    # decoder accepts both forms from anyone (only what is sent depends on the version)
    agent = Connection(Role.AGENT, token=TOKEN, version=1)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    _handshake(agent, coordinator)
    packed = {"t": "flows", "progress_ids": [3], "progress_sent": [4]}
    coordinator.receive_data(frame(msgpack.packb(packed)))
    assert coordinator.next_event() == Flows(progress_ids=(3,), progress_sent=(4,))


def test_flows_refuses_progress_arrays_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 progress_ids but 1 progress_sent"):
        Flows(progress_ids=(1, 2), progress_sent=(3,))
    assert list(BATCH.reports()) == [(1, 0), (2, 655360), (2**64 - 1, 7)]
