"""Version 3's mutual handshake: the coordinator proves it holds the token by its welcome MAC,
and an agent refuses a coordinator that cannot (audit finding H1)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from flowsched.protocol import (
    JOB_END_VERSION,
    MUTUAL_AUTH_VERSION,
    NEED_DATA,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Connection,
    Heartbeat,
    Hello,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    Resync,
    Role,
    State,
    Welcome,
    compute_mac,
    compute_welcome_mac,
    encode_body,
    frame,
    verify_welcome_mac,
    welcome_digest,
)
from flowsched.protocol.aio import HandshakeError, _Secure, connect_agent
from flowsched.testbed.daemons import wait_until
from flowsched.tls import client_context

TOKEN = b"k" * 32
WELCOME = Welcome("[policy]\n", 0.05, 1.0, 0.2, 7, 9)


def _up_to_welcome(agent: Connection, coordinator: Connection, node: str = "n1") -> bytes:
    """Run the handshake up to the coordinator's welcome frame, which is returned unread."""
    coordinator.receive_data(agent.hello(node))
    assert isinstance(coordinator.next_event(), Hello)
    agent.receive_data(coordinator.challenge())
    challenge = agent.next_event()
    assert isinstance(challenge, Challenge)
    coordinator.receive_data(agent.answer(challenge))
    assert isinstance(coordinator.next_event(), Auth)
    return coordinator.send(WELCOME)


def _refused(agent: Connection, welcome_frame: bytes) -> RemoteProtocolError:
    agent.receive_data(welcome_frame)
    with pytest.raises(RemoteProtocolError) as info:
        agent.next_event()
    assert info.value.code == "auth_failed"
    assert agent.state is State.ERROR and not agent.peer_proven
    with pytest.raises(LocalProtocolError):  # nothing more goes to that peer
        agent.send(Resync())
    return info.value


def test_a_coordinator_with_the_token_proves_it() -> None:
    agent = Connection(Role.AGENT, token=TOKEN)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    agent.receive_data(_up_to_welcome(agent, coordinator))
    received = agent.next_event()
    assert received == WELCOME and isinstance(received, Welcome) and len(received.mac) == 32
    assert agent.version == coordinator.version == PROTOCOL_VERSION >= MUTUAL_AUTH_VERSION
    assert agent.peer_proven and coordinator.peer_proven
    assert agent.state is State.ESTABLISHED


def test_a_coordinator_without_the_token_is_refused() -> None:
    # the audit's rogue listener: a coordinator end with no token answers every hello
    agent = Connection(Role.AGENT, token=TOKEN)
    rogue = Connection(Role.COORDINATOR, token=None)
    error = _refused(agent, _up_to_welcome(agent, rogue))
    assert f"welcome.mac: missing at protocol version {PROTOCOL_VERSION}" in error.reason


def test_a_coordinator_with_another_token_is_refused() -> None:
    agent = Connection(Role.AGENT, token=TOKEN)
    rogue = Connection(Role.COORDINATOR, token=b"w" * 32)
    rogue._check_mac = lambda mac: None  # type: ignore[method-assign]  # (it cannot check ours)
    error = _refused(agent, _up_to_welcome(agent, rogue))
    assert "welcome.mac: wrong MAC" in error.reason


@pytest.mark.parametrize(
    "field", [f.name for f in dataclasses.fields(Welcome) if f.name != "mac"]
)  # every field: one added to Welcome and not to welcome_digest fails here
def test_a_welcome_altered_on_the_way_is_refused(field: str) -> None:
    agent = Connection(Role.AGENT, token=TOKEN)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    body = msgpack.unpackb(_up_to_welcome(agent, coordinator)[4:])
    value = getattr(WELCOME, field)
    body[field] = value + ("x" if isinstance(value, str) else 1)  # e.g. a huge epoch
    error = _refused(agent, frame(msgpack.packb(body, use_bin_type=True)))
    assert "welcome.mac: wrong MAC" in error.reason


def test_a_welcome_replayed_from_another_connection_is_refused() -> None:
    earlier = Connection(Role.AGENT, token=TOKEN)
    recorded = _up_to_welcome(earlier, Connection(Role.COORDINATOR, token=TOKEN))
    # a listener without the token replays it: the agent's fresh nonce differs
    agent = Connection(Role.AGENT, token=TOKEN)
    _up_to_welcome(agent, Connection(Role.COORDINATOR, token=None))
    assert "wrong MAC" in _refused(agent, recorded).reason


def _offer_rewritten(agent: Connection, coordinator: Connection, offer: int) -> bytes:
    """Someone on the path rewrites the agent's offer to ``offer``; returns the agent's auth
    frame, answering the coordinator's real challenge."""
    hello = msgpack.unpackb(agent.hello("n1")[4:])
    coordinator.receive_data(frame(msgpack.packb({**hello, "version": offer}, use_bin_type=True)))
    assert isinstance(coordinator.next_event(), Hello)
    agent.receive_data(coordinator.challenge())
    challenge = agent.next_event()
    assert isinstance(challenge, Challenge)
    return agent.answer(challenge)


def test_the_welcome_mac_binds_the_version_the_agent_offered() -> None:
    # at version 4 the agent's MAC covers no version: the coordinator's MAC covers what it
    # received, so the agent refuses the welcome
    agent = Connection(Role.AGENT, token=TOKEN, version=JOB_END_VERSION)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN, version=JOB_END_VERSION)
    coordinator.receive_data(_offer_rewritten(agent, coordinator, 9))
    coordinator.next_event()
    assert "wrong MAC" in _refused(agent, coordinator.send(WELCOME)).reason


def test_from_version_5_the_agents_mac_binds_the_offer() -> None:
    """A rewritten offer makes the coordinator refuse the agent's auth: no session opens in
    the agent's name. (Rewritten down to 4, the challenge says 4 and connect_agent refuses to
    answer: test_a_version_5_agent_does_not_answer_a_coordinator_below_5.)"""
    agent = Connection(Role.AGENT, token=TOKEN)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    auth = _offer_rewritten(agent, coordinator, 9)
    coordinator.receive_data(auth)
    with pytest.raises(RemoteProtocolError) as info:
        coordinator.next_event()
    assert info.value.code == "auth_failed" and coordinator.state is State.ERROR


def test_a_version_5_auth_never_passes_for_the_older_form() -> None:
    """Someone on the path tells the coordinator the agent offered 4 and the agent that the
    coordinator answered 5: the agent's bound MAC is refused at version 4."""
    agent = Connection(Role.AGENT, token=TOKEN)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    hello = msgpack.unpackb(agent.hello("n1")[4:])
    coordinator.receive_data(frame(msgpack.packb({**hello, "version": 4}, use_bin_type=True)))
    coordinator.next_event()
    real = msgpack.unpackb(coordinator.challenge()[4:])
    agent.receive_data(frame(msgpack.packb({**real, "version": 5}, use_bin_type=True)))
    challenge = agent.next_event()
    assert isinstance(challenge, Challenge) and agent.version == 5
    coordinator.receive_data(agent.answer(challenge))
    with pytest.raises(RemoteProtocolError) as info:
        coordinator.next_event()
    assert info.value.code == "auth_failed" and coordinator.version == 4


def test_a_hello_offering_version_3_needs_a_nonce() -> None:
    coordinator = Connection(Role.COORDINATOR, token=TOKEN)
    coordinator.receive_data(frame(encode_body(Hello(3, "n1"))))
    with pytest.raises(RemoteProtocolError) as info:
        coordinator.next_event()
    assert (info.value.code, info.value.reason) == (
        "bad_field", "hello.nonce: missing (an agent offering version 3 sends one)"
    )  # fmt: skip


@pytest.mark.parametrize("held_at", [1, 2])
def test_below_version_3_nothing_is_proven(held_at: int) -> None:
    # the Connection does not decide whether that is acceptable: connect_agent does
    agent = Connection(Role.AGENT, token=TOKEN)
    coordinator = Connection(Role.COORDINATOR, token=TOKEN, version=held_at)
    welcome_frame = _up_to_welcome(agent, coordinator)
    assert "mac" not in msgpack.unpackb(welcome_frame[4:])  # what such a coordinator sends
    agent.receive_data(welcome_frame)
    assert agent.next_event() == WELCOME
    assert agent.version == held_at and not agent.peer_proven and coordinator.peer_proven


def test_the_welcome_mac_covers_each_input_and_differs_from_the_auth_mac() -> None:
    inputs: dict[str, Any] = {
        "agent_nonce": b"a" * 32, "coordinator_nonce": b"c" * 32, "node": "n1",
        "offered": 3, "version": 3, "digest": welcome_digest(WELCOME),
    }  # fmt: skip
    mac = compute_welcome_mac(TOKEN, **inputs)
    assert verify_welcome_mac(TOKEN, mac, **inputs)
    assert not verify_welcome_mac(b"w" * 32, mac, **inputs)
    changed = {"agent_nonce": b"b" * 32, "coordinator_nonce": b"d" * 32, "node": "n2",
               "offered": 4, "version": 2, "digest": bytes(32)}  # fmt: skip
    for name, value in changed.items():
        assert not verify_welcome_mac(TOKEN, mac, **{**inputs, name: value}), name
    # the agent's auth MAC over the same nonce and node is no welcome MAC
    assert compute_mac(TOKEN, b"c" * 32, "n1") != mac
    with pytest.raises(ValueError, match="agent_nonce: expected 32 bytes, got 0"):
        compute_welcome_mac(TOKEN, **{**inputs, "agent_nonce": b""})


# -- connect_agent against stand-in coordinators ---------------------------------------------


@contextlib.asynccontextmanager
async def _stand_in(
    *, token: bytes | None = TOKEN, version: int = PROTOCOL_VERSION, previous: bool = False
) -> AsyncIterator[tuple[int, list[list[str]]]]:
    """A coordinator end on 127.0.0.1 speaking up to ``version`` (with ``previous``: one of
    the previous release, which refuses a hello with fields it does not know); yields its
    port and, per connection, the types of the frames it received."""
    received: list[list[str]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(Role.COORDINATOR, token=token, version=version)
        kinds: list[str] = []
        received.append(kinds)
        try:
            while data := await reader.read(65536):
                if previous and not kinds and b"nonce" in data:
                    kinds.append("hello")
                    writer.write(conn.send_error("bad_field", "hello: unknown field(s) nonce"))
                    break
                conn.receive_data(data)
                while (event := conn.next_event()) is not NEED_DATA:
                    assert isinstance(event, Message)
                    kinds.append(event.TYPE)
                    if isinstance(event, Hello):
                        writer.write(conn.challenge())
                    elif isinstance(event, Auth):  # a heartbeat follows, sealed from 5
                        writer.write(conn.send(WELCOME) + conn.send(Heartbeat(1.0)))
        except (RemoteProtocolError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], received
    finally:
        server.close()
        await server.wait_closed()


async def _connect(port: int, **options: Any) -> Any:
    return await connect_agent("127.0.0.1", port, node="n1", token=TOKEN, timeout=5, **options)


@pytest.mark.asyncio
async def test_connect_agent_accepts_a_coordinator_that_proves_itself() -> None:
    async with _stand_in() as (port, received):
        link = await _connect(port)
        await link.close()
    assert (link.version, link.coordinator_proven) == (PROTOCOL_VERSION, True)
    assert received == [["hello", "auth"]]


@pytest.mark.asyncio
async def test_connect_agent_refuses_a_listener_without_the_token() -> None:
    async with _stand_in(token=None) as (port, received):
        with pytest.raises(HandshakeError) as info:
            await _connect(port, allow_unproven=True)  # no excuse at version 3
        await asyncio.sleep(0.05)
    assert info.value.by_agent and info.value.code == "auth_failed"
    assert str(info.value).startswith("auth_failed: welcome.mac: missing")
    # told why, in a frame sealed after its auth: one that only the token's holder can read
    assert received == [["hello", "auth"]]


@pytest.mark.asyncio
async def test_connect_agent_refuses_a_coordinator_held_below_version_3() -> None:
    async with _stand_in(version=2) as (port, received):
        with pytest.raises(HandshakeError) as info:
            await _connect(port)
        await asyncio.sleep(0.05)
    assert info.value.by_agent and info.value.code == "unproven_coordinator"
    assert "answered with protocol version 2" in info.value.reason
    assert "--allow-unproven-coordinator" in info.value.reason
    assert received == [["hello", "error"]]  # not even the agent's MAC went there


@pytest.mark.parametrize("held_at", [3, JOB_END_VERSION])
@pytest.mark.asyncio
async def test_a_version_5_agent_does_not_answer_a_coordinator_below_5(held_at: int) -> None:
    """A coordinator (or someone on the path saying so) that answers below version 5 gets no
    auth: that answer would be of the older form, which a coordinator accepts for an
    unsealed session in this node's name. Allowed (rolling upgrade), the link is unsealed."""
    async with _stand_in(version=held_at) as (port, received):
        with pytest.raises(HandshakeError) as info:
            await _connect(port)
        await asyncio.sleep(0.05)
        assert info.value.by_agent and info.value.code == "unproven_coordinator"
        assert f"answered with protocol version {held_at}: below 5 it does not seal" in (
            info.value.reason
        )
        assert received == [["hello", "error"]]  # no MAC went there
        link = await _connect(port, allow_unproven=True)
        try:
            assert (link.version, link.coordinator_proven, link.sealed) == (held_at, True, False)
            assert isinstance(await link.recv(5), Heartbeat)  # established traffic, unsealed
            await link.send(Resync(()))
            await wait_until(lambda: received[-1][-1:] == ["resync"], 5, "the resync to arrive")
            assert received[-1] == ["hello", "auth", "resync"]
        finally:
            await link.close()


@pytest.mark.asyncio
async def test_connect_agent_takes_an_unproven_coordinator_when_allowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="flowsched.protocol.aio")
    async with _stand_in(version=2) as (port, _):
        link = await _connect(port, allow_unproven=True)
        await link.close()
    assert (link.version, link.coordinator_proven) == (2, False)
    assert "cannot prove that it holds the token" in caplog.text


@pytest.mark.asyncio
async def test_a_previous_release_coordinator_is_refused_unless_allowed() -> None:
    # it refuses the version-3 hello (its nonce is a field it does not know); the agent does
    # not retry with version 1 unless told to
    async with _stand_in(version=1, previous=True) as (port, received):
        with pytest.raises(HandshakeError) as info:
            await _connect(port)
        assert info.value.code == "unproven_coordinator"
        assert f"refused protocol version {PROTOCOL_VERSION} (hello: unknown field(s) nonce)" in (
            info.value.reason
        )
        assert received == [["hello"]]
        link = await _connect(port, allow_unproven=True)
        await link.close()
        assert (link.version, link.coordinator_proven) == (1, False)
        assert received[1:] == [["hello"], ["hello", "auth"]]


def test_verified_tls_authenticates_the_coordinator_instead() -> None:
    assert _Secure(client_context(None), None).may_skip_proof()
    unverified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE
    assert not _Secure(unverified, None).may_skip_proof()
    assert not _Secure(None, None).may_skip_proof()
    assert _Secure(None, None, allow_unproven=True).may_skip_proof()
