"""The agent link over TLS: real handshakes on port 0, under asyncio's loop and uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import socket
import ssl
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from coordinator_helpers import TOKEN, running_coordinator, wait_until

from flowsched import tls
from flowsched.coordinator import Coordinator, CoordinatorConfig, tls_accept
from flowsched.coordinator.connection import CLOSE_TIMEOUT, TLS_EARLY_LIMIT, ClientHelloWatch
from flowsched.model import FlowClass
from flowsched.protocol import FlowOpen, Flows, Levels, LevelUpdate, Message, Resync
from flowsched.protocol.aio import AgentLink, HandshakeError, connect_agent

TlsFiles = Any  # tests/conftest.py's (conftest modules are not imported by name)
Runner = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Runs a scenario on asyncio's loop, then on uvloop's: their TLS layers differ, and both
    must take over a connection whose client hello the coordinator already read."""
    runner: Runner = asyncio.run if request.param == "asyncio" else uvloop.run
    return runner


def _server(files: TlsFiles, mutual: bool = False) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "tls_cert": str(files.server_cert),
        "tls_key": str(files.server_key),
    }
    if mutual:
        settings["tls_client_ca"] = str(files.ca)
    return settings


def _server_pair_copy(files: TlsFiles, folder: Path) -> tuple[Path, Path]:
    """A copy of the server's certificate and key that a test may replace (a renewal)."""
    cert, key = folder / "server.pem", folder / "server.key"
    shutil.copy(files.server_cert, cert)
    shutil.copy(files.server_key, key)
    return cert, key


async def _connect(
    coordinator: Coordinator,
    context: ssl.SSLContext | None,
    name: str | None = None,
    node: str = "n1",
) -> AgentLink:
    assert coordinator.addresses is not None
    return await connect_agent(
        coordinator.addresses.host, coordinator.addresses.port, node=node, token=TOKEN,
        timeout=5, tls=context, server_hostname=name,
    )  # fmt: skip


async def _levels_for_one_flow(link: AgentLink) -> Levels:
    await link.send(Resync(()))
    await link.send(Flows(opens=(FlowOpen(1, FlowClass.KV, time.time()),)))
    deadline = time.monotonic() + 5
    while True:
        message: Message = await link.recv(max(deadline - time.monotonic(), 0.01))
        if isinstance(message, Levels):
            return message


@pytest.mark.parametrize("mutual", [False, True], ids=["server-auth", "mutual"])
def test_an_agent_over_tls_reports_flows_and_gets_levels(
    run: Runner, tls_files: TlsFiles, mutual: bool
) -> None:
    async def scenario() -> None:
        async with running_coordinator(**_server(tls_files, mutual)) as coordinator:
            context = tls.client_context(
                str(tls_files.ca), str(tls_files.client_cert), str(tls_files.client_key)
            )
            # the client certificate's CN: under mutual TLS an agent logs in as a node it names
            link = await _connect(coordinator, context, node="client")
            try:
                assert (await _levels_for_one_flow(link)).updates == (LevelUpdate(1, 7),)
                assert link.cipher is not None  # the link is encrypted
            finally:
                await link.close()

    run(scenario())


#: (case, client CA, client certificate, server name) -> error code and words in its reason
REFUSED = [
    ("no TLS", None, None, None, "closed", "serves TLS"),
    ("CA that did not sign the server", "other_ca", None, None, "tls", "failed verification"),
    ("name not in the certificate", "ca", None, "coordinator.example", "tls", "Hostname mismatch"),
]
MUTUAL_REFUSED = [
    ("no client certificate", None, "client certificate it trusts"),
    ("client certificate of another CA", "stranger", "client certificate it trusts"),
]


@pytest.mark.parametrize(("case", "ca", "cert", "name", "code", "words"), REFUSED)
def test_a_refused_tls_handshake_says_why_and_harms_no_other_agent(
    run: Runner, tls_files: TlsFiles, case: str, ca: str | None, cert: str | None,
    name: str | None, code: str, words: str,
) -> None:  # fmt: skip
    async def scenario() -> None:
        async with running_coordinator(**_server(tls_files)) as coordinator:
            context = None if ca is None else tls.client_context(str(getattr(tls_files, ca)))
            with pytest.raises(HandshakeError) as refused:
                await _connect(coordinator, context, name)
            assert refused.value.code == code and words in refused.value.reason, case
            good = await _connect(coordinator, tls.client_context(str(tls_files.ca)))
            try:
                assert (await _levels_for_one_flow(good)).updates == (LevelUpdate(1, 7),)
            finally:
                await good.close()
            assert coordinator.unauthenticated_count == 0

    run(scenario())


@pytest.mark.parametrize(("case", "cert", "words"), MUTUAL_REFUSED)
def test_mutual_tls_refuses_agents_without_a_trusted_certificate_and_logs_the_peer(
    run: Runner,
    tls_files: TlsFiles,
    case: str,
    cert: str | None,
    words: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        caplog.set_level(logging.WARNING, "flowsched.coordinator")
        async with running_coordinator(**_server(tls_files, mutual=True)) as coordinator:
            files = (None, None)
            if cert is not None:
                files = (
                    str(getattr(tls_files, f"{cert}_cert")),
                    str(getattr(tls_files, f"{cert}_key")),
                )
            context = tls.client_context(str(tls_files.ca), *files)
            with pytest.raises(HandshakeError) as refused:
                await _connect(coordinator, context)
            assert words in refused.value.reason, case
            assert coordinator.live.rejected == {"tls": 1}
            assert coordinator.turned_away_lately() == 0  # refused, not turned away unserved
            logged = [r.getMessage() for r in caplog.records]
            logged = [line for line in logged if "TLS handshake with" in line]
            assert len(logged) == 1 and "127.0.0.1:" in logged[0], logged

    run(scenario())


#: (node the agent logs in as, tls_client_names) -> admitted; the client certificate has CN
#: "client-cn" and subjectAltName DNS:client, DNS:localhost, IP:127.0.0.1
NODE_NAMES = [
    ("client", "node", True),  # a DNS subjectAltName
    ("localhost", "node", True),
    ("client-cn", "node", False),  # the subject's CN does not count next to DNS alt names
    ("127.0.0.1", "node", False),  # an IP subjectAltName names an address, not a node
    ("n2", "node", False),
    ("Client", "node", False),  # names compare exactly
    ("n2", "any", True),
]


@pytest.mark.parametrize(("node", "names", "admitted"), NODE_NAMES)
def test_mutual_tls_admits_an_agent_only_as_a_node_its_certificate_names(
    run: Runner, tls_files: TlsFiles, node: str, names: str, admitted: bool
) -> None:
    async def scenario() -> None:
        settings = _server(tls_files, mutual=True) | {"tls_client_names": names}
        async with running_coordinator(**settings) as coordinator:
            context = tls.client_context(
                str(tls_files.ca), str(tls_files.client_cert), str(tls_files.client_key)
            )
            if not admitted:
                with pytest.raises(HandshakeError) as refused:
                    await _connect(coordinator, context, node=node)
                assert refused.value.code == "auth_failed"
                assert f"node '{node}' is not a name of the client certificate" in (
                    refused.value.reason
                )
                assert "'client'" in refused.value.reason  # its names, for the operator
                assert coordinator.live.rejected == {"auth_failed": 1}
                assert node not in coordinator.sessions
                node_admitted = "client"  # another agent is not harmed
            else:
                node_admitted = node
            link = await _connect(coordinator, context, node=node_admitted)
            try:
                assert (await _levels_for_one_flow(link)).updates == (LevelUpdate(1, 7),)
            finally:
                await link.close()

    run(scenario())


_SUBJECT = ((("organizationName", "acme"),), (("commonName", "gpu-1"),))


@pytest.mark.parametrize(
    ("peer", "names"),
    [
        pytest.param(
            {
                "subject": _SUBJECT,
                "subjectAltName": (
                    ("DNS", "gpu-1.example"),
                    ("IP Address", "10.0.0.1"),
                    ("DNS", "g1"),
                ),
            },
            ("gpu-1.example", "g1"),
            id="alt-names-only-the-common-name-ignored",
        ),
        pytest.param(
            {"subject": _SUBJECT, "subjectAltName": (("IP Address", "10.0.0.1"),)},
            ("gpu-1",),
            id="no-dns-alt-name-the-common-name",
        ),
        pytest.param({"subject": _SUBJECT}, ("gpu-1",), id="no-alt-names-the-common-name"),
        pytest.param({}, (), id="empty"),
        pytest.param(None, (), id="no-certificate"),
    ],
)
def test_certificate_names_are_the_dns_alt_names_else_the_common_names(
    peer: dict[str, object] | None, names: tuple[str, ...]
) -> None:
    assert tls.certificate_names(peer) == names


def test_config_refuses_an_unknown_client_names_rule() -> None:
    with pytest.raises(ValueError, match="tls_client_names: expected 'node' or 'any'"):
        CoordinatorConfig(token=TOKEN, policy_factory=object, tls_client_names="cn")  # type: ignore[arg-type]


@pytest.mark.parametrize("sent", ["part of a hello", "a hello"])
def test_a_tls_handshake_not_finished_in_time_is_turned_away(
    run: Runner, tls_files: TlsFiles, sent: str
) -> None:
    """Whether the peer stalls before its hello is complete or after (the TLS layer then
    waits for the rest of its handshake: its own timeout ended that as an abort, taken for
    the peer's doing, neither counted nor turned away)."""

    async def scenario() -> None:
        settings = {**_server(tls_files), "handshake_timeout": 0.3}
        async with running_coordinator(**settings) as coordinator:
            assert coordinator.addresses is not None
            reader, writer = await asyncio.open_connection(
                coordinator.addresses.host, coordinator.addresses.port
            )
            hello = _client_hello()
            writer.write(hello if sent == "a hello" else hello[:3])  # and no more
            async with asyncio.timeout(5):
                while await reader.read(1 << 16):  # until the coordinator gives up on it
                    pass
            writer.close()
            await wait_until(lambda: coordinator.live.rejected.get("tls"), 5, "the rejection")
            # a standby must not count an agent an overloaded leader could not serve in time
            # as cut off from it (flowsched.coordinator.reach)
            assert coordinator.turned_away_lately() == 1

    run(scenario())


def test_the_handshake_deadline_counts_from_the_accept_over_tls_too(
    run: Runner, tls_files: TlsFiles
) -> None:
    """A peer that sends its client hello late, completes TLS and then stays silent is cut off
    ``handshake_timeout`` after it connected: the TLS handshake does not start a second
    ``handshake_timeout`` for the agent's hello (an unauthenticated peer held its connection
    for up to twice as long)."""
    timeout, late = 2.0, 1.4

    async def scenario() -> None:
        settings = {**_server(tls_files), "handshake_timeout": timeout}
        async with running_coordinator(**settings) as coordinator:
            assert coordinator.addresses is not None
            loop = asyncio.get_running_loop()
            reader, writer = await asyncio.open_connection(
                coordinator.addresses.host, coordinator.addresses.port
            )
            connected = loop.time()
            await asyncio.sleep(late)  # the slow peer: its hello comes this late
            await writer.start_tls(
                tls.client_context(str(tls_files.ca)), server_hostname="localhost"
            )
            async with asyncio.timeout(3 * timeout):
                while await reader.read(1 << 16):  # silent: until the coordinator ends it
                    pass
            ended = loop.time() - connected
            writer.close()
            assert ended < timeout + (timeout - late) / 2, f"cut off after {ended:.2f} s"
            await wait_until(lambda: coordinator.live.rejected.get("timeout"), 5, "the timeout")

    run(scenario())


def test_a_port_probe_is_not_a_failed_handshake(
    run: Runner, tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        # the standby's liveness probe and load-balancer checks connect and close at once
        caplog.set_level(logging.WARNING, "flowsched.coordinator")
        async with running_coordinator(**_server(tls_files)) as coordinator:
            assert coordinator.addresses is not None
            _, writer = await asyncio.open_connection(
                coordinator.addresses.host, coordinator.addresses.port
            )
            writer.close()
            await writer.wait_closed()
            good = await _connect(coordinator, tls.client_context(str(tls_files.ca)))
            await good.close()
            await wait_until(lambda: not coordinator._tls_pending, 5, "no handshake left")
            assert "tls" not in (coordinator.live.rejected or {})
            assert not [r for r in caplog.records if "TLS handshake" in r.getMessage()]

    run(scenario())


def test_a_peer_flooding_bytes_before_the_tls_handshake_is_cut_off(
    run: Runner,
    tls_files: TlsFiles,
) -> None:
    async def scenario() -> None:
        async with running_coordinator(**_server(tls_files)) as coordinator:
            assert coordinator.addresses is not None
            reader, writer = await asyncio.open_connection(
                coordinator.addresses.host, coordinator.addresses.port
            )
            garbage = b"\x16\x03\x01" + bytes(4 * TLS_EARLY_LIMIT)
            try:
                writer.write(garbage)
                async with asyncio.timeout(5):
                    assert await reader.read() == b""  # closed by the coordinator
            except ConnectionError:
                pass  # reset while still sending: cut off as well
            finally:
                writer.close()
            await wait_until(lambda: not coordinator._tls_pending, 5, "the flood's handshake gone")

    run(scenario())


def test_pending_tls_handshakes_count_against_the_unauthenticated_cap(
    run: Runner,
    tls_files: TlsFiles,
) -> None:
    async def scenario() -> None:
        overrides = {**_server(tls_files), "max_unauthenticated": 3, "handshake_timeout": 30}
        async with running_coordinator(**overrides) as coordinator:
            assert coordinator.addresses is not None
            address = coordinator.addresses.host, coordinator.addresses.port
            silent = [await asyncio.open_connection(*address) for _ in range(3)]
            hello = b"\x16\x03\x01\x00\x05"  # the start of a TLS record: a handshake under way
            for _, writer in silent:
                writer.write(hello)
            await wait_until(lambda: len(coordinator._tls_pending) == 3, 5, "3 pending handshakes")
            good = await _connect(coordinator, tls.client_context(str(tls_files.ca)))
            try:
                assert coordinator.live.rejected == {"evicted": 1}  # the oldest silent one
                assert len(coordinator._tls_pending) == 2
            finally:
                await good.close()
                for _, writer in silent:
                    writer.close()

    run(scenario())


def client_hello_complete(data: bytes) -> bool:
    """Whether ``data``, received at once, holds a whole client hello."""
    return ClientHelloWatch().complete(data)


def _memory_client() -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    """A TLS client on memory buffers (its incoming and outgoing bytes) whose first flight,
    its client hello, waits in ``outgoing``."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return client, incoming, outgoing


def _client_hello() -> bytes:
    """A real TLS client hello, as an agent's first flight."""
    return _memory_client()[2].read()


@pytest.mark.parametrize(
    ("data", "complete"),
    [
        (b"", False),
        (b"\x16", False),
        (b"\x16\x03\x01\x00", False),  # header cut short
        (b"\x16\x03\x01\x00\x05abcd", False),  # one body byte missing
        (b"\x16\x03\x01\x00\x05abcde", True),
        (b"\x16\x03\x01\x00\x05abcdef", True),  # the next record's first byte too
        (b"GET / HTTP/1.1\r\n", True),  # not TLS: the handshake fails at once, with its reason
        (b"\x80\x2e\x01", True),  # an SSLv2-style hello: no handshake record either
    ],
    ids=["empty", "type-only", "short-header", "short-body", "whole", "more", "http", "sslv2"],
)
def test_a_hello_is_complete_with_its_whole_first_record(data: bytes, complete: bool) -> None:
    assert client_hello_complete(data) is complete


def test_a_real_client_hello_is_one_complete_record() -> None:
    hello = _client_hello()
    assert client_hello_complete(hello)
    assert not client_hello_complete(hello[:-1])


def _split_hello(hello: bytes, *sizes: int) -> list[bytes]:
    """``hello`` (one record) as records of ``sizes`` bytes of its handshake message, then
    one record of the rest: as TLS allows any handshake message to be fragmented."""
    body, records = hello[5:], []
    for size in (*sizes, len(hello)):
        part, body = body[:size], body[size:]
        records.append(hello[:3] + struct.pack(">H", len(part)) + part)
        if not body:
            break
    return records


@pytest.mark.parametrize("sizes", [(20,), (2,), (1, 1, 1), (0, 3, 0, 40)])
def test_a_hello_split_over_records_is_complete_only_with_its_last(
    sizes: tuple[int, ...],
) -> None:
    """A peer whose first record held a few bytes of its hello got a handshake turn for them,
    then sent the rest when it chose, with every other such peer: the TLS layer answered them
    all in one loop turn (1,500 of them held the coordinator's loop 1.5 s)."""
    records = _split_hello(_client_hello(), *sizes)
    assert len(records) == len(sizes) + 1
    watch, received = ClientHelloWatch(), b""
    for record in records[:-1]:
        for byte in range(len(record)):  # as it arrives, a byte at a time
            received += record[byte : byte + 1]
            assert not watch.complete(received)
    received += records[-1]
    assert watch.complete(received)
    assert client_hello_complete(received)
    assert not client_hello_complete(received[:-1])


def test_a_first_record_that_is_no_hello_is_complete_at_once() -> None:
    # a handshake message of another type, or an alert record after half a hello: the TLS
    # layer refuses either at once, so the handshake may start
    assert client_hello_complete(b"\x16\x03\x01\x00\x04\x02\x00\x00\x00")
    first = _split_hello(_client_hello(), 20)[0]
    assert not client_hello_complete(first)
    assert client_hello_complete(first + b"\x15\x03\x03\x00\x02\x02\x28")


CHANGE_CIPHER_SPEC = b"\x14\x03\x03\x00\x01\x01"


@pytest.mark.parametrize(
    ("records", "complete", "hello_seen"),
    [
        ([CHANGE_CIPHER_SPEC], False, False),  # the hello comes next
        ([CHANGE_CIPHER_SPEC[:3]], False, False),
        ([CHANGE_CIPHER_SPEC, b"\x16\x03\x03\x00\x05\x01\x00\x00\x01x"], True, True),
        ([CHANGE_CIPHER_SPEC, b"\x16\x03\x03\x00\x05\x01\x00\x00\x02x"], False, True),
        ([b"\x16\x03\x03\x00\x05\x01\x00\x00\x01x"], True, True),
        ([CHANGE_CIPHER_SPEC, b"\x17\x03\x03\x00\x02ab"], True, False),  # a 1.3 Finished
        ([b"\x16\x03\x03\x00\x05\x10\x00\x00\x01x"], True, False),  # 1.2 key exchange
    ],
    ids=["ccs", "part-of-ccs", "ccs-hello", "ccs-half-hello", "hello", "finished", "not-hello"],
)
def test_after_a_first_hello_change_cipher_specs_before_a_hello_are_skipped(
    records: list[bytes], complete: bool, hello_seen: bool
) -> None:
    watch = ClientHelloWatch(after_retry=True)
    assert watch.complete(b"".join(records)) is complete
    assert watch.hello_seen is hello_seen


def test_the_records_after_a_whole_hello_are_left_to_the_next_reader() -> None:
    hello, finished = _client_hello(), b"\x17\x03\x03\x00\x02ab"
    watch = ClientHelloWatch()
    assert watch.complete(hello)
    for more in (CHANGE_CIPHER_SPEC, hello):  # another hello too: it must wait for a turn
        assert watch.complete(hello + more) and watch.records_end == len(hello)
    assert watch.complete(hello + finished) and watch.records_end == len(hello)


def test_a_change_cipher_spec_first_is_no_first_hello() -> None:
    assert client_hello_complete(CHANGE_CIPHER_SPEC + _client_hello())


def test_the_pace_lets_at_most_per_turn_callers_through_each_turn() -> None:
    async def scenario() -> list[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        turns = 0

        def tick() -> None:  # once per loop turn
            nonlocal turns
            turns += 1
            loop.call_soon(tick)

        tick()
        pace = tls_accept.HandshakePace(per_turn=2)
        passed: list[tuple[int, int]] = []

        async def caller(index: int) -> None:
            await pace.turn()
            passed.append((index, turns))

        tasks = [asyncio.ensure_future(caller(i)) for i in range(7)]
        await asyncio.sleep(0)  # every caller asked
        tasks[3].cancel()  # a caller gone while waiting takes no slot
        await asyncio.gather(*tasks, return_exceptions=True)
        return passed

    passed = asyncio.run(scenario())
    assert [index for index, _ in passed] == [0, 1, 2, 4, 5, 6]  # first come, first served
    per_turn: dict[int, int] = {}
    for _, turn in passed:
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert max(per_turn.values()) == 2 and len(per_turn) == 3, per_turn


def test_the_pace_refuses_an_empty_turn() -> None:
    with pytest.raises(ValueError, match="per_turn"):
        tls_accept.HandshakePace(per_turn=0)


class _LoopTurns:
    """Counts the running event loop's turns from :meth:`start` on."""

    def __init__(self) -> None:
        self.count = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self.count += 1
            loop.call_soon(tick)  # (once per turn, until the loop ends)

        tick()


@contextlib.asynccontextmanager
async def _paced_coordinator(
    tls_files: TlsFiles,
) -> AsyncIterator[tuple[Coordinator, tuple[str, int]]]:
    """A TLS coordinator that starts 3 handshakes per loop turn, and its address."""
    overrides = {**_server(tls_files), "handshake_timeout": 30}
    async with running_coordinator(**overrides) as coordinator:
        coordinator._handshake_pace = tls_accept.HandshakePace(per_turn=3)
        assert coordinator.addresses is not None
        yield coordinator, (coordinator.addresses.host, coordinator.addresses.port)


async def _an_agent_gets_its_levels(coordinator: Coordinator, tls_files: TlsFiles) -> None:
    """An agent that trusts the test CA logs in and gets its flow's level."""
    good = await _connect(coordinator, tls.client_context(str(tls_files.ca)))
    try:
        assert (await _levels_for_one_flow(good)).updates == (LevelUpdate(1, 7),)
    finally:
        await good.close()


def test_a_flood_of_hellos_is_answered_a_few_per_turn_and_half_hellos_wait(
    run: Runner, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    # answering a hello costs the key exchange and a signature: a flood answered in one loop
    # turn would silence every agent's heartbeats; half a hello must not hold a slot
    started: list[int] = []
    real_handshake = tls_accept.handshake
    turns = _LoopTurns()

    async def recording(*args: Any, **kwargs: Any) -> Any:
        started.append(turns.count)
        return await real_handshake(*args, **kwargs)

    monkeypatch.setattr(tls_accept, "handshake", recording)

    async def scenario() -> None:
        turns.start()
        async with _paced_coordinator(tls_files) as (coordinator, address):
            hello = _client_hello()
            half = [await asyncio.open_connection(*address) for _ in range(5)]
            for _, writer in half:
                writer.write(hello[: len(hello) // 2])
            flood = [await asyncio.open_connection(*address) for _ in range(30)]
            for _, writer in flood:
                writer.write(hello)
            # every complete hello is answered: the server's first flight comes back
            answers = await asyncio.gather(*(reader.read(5) for reader, _ in flood))
            assert all(answer[:1] == b"\x16" for answer in answers)
            await _an_agent_gets_its_levels(coordinator, tls_files)
            assert len(started) == 31  # the flood and the agent; no half hello
            assert len(coordinator._tls_pending) == 35  # still counted against the caps
            for _, writer in half + flood:
                writer.close()
        assert max(Counter(started).values()) <= 3, Counter(started)

    run(scenario())


def test_a_hello_split_over_records_gets_a_handshake_turn_only_once_whole(
    run: Runner, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hello's first record alone (a few bytes of the hello) took a handshake turn: the
    peers' later records were then answered, key exchange and signature, all in one loop turn."""
    started: list[int] = []
    real_handshake = tls_accept.handshake

    async def recording(*args: Any, **kwargs: Any) -> Any:
        started.append(1)
        return await real_handshake(*args, **kwargs)

    monkeypatch.setattr(tls_accept, "handshake", recording)

    async def scenario() -> None:
        overrides = {**_server(tls_files), "handshake_timeout": 30}
        async with running_coordinator(**overrides) as coordinator:
            assert coordinator.addresses is not None
            address = coordinator.addresses.host, coordinator.addresses.port
            first, rest = _split_hello(_client_hello(), 20)
            peers = [await asyncio.open_connection(*address) for _ in range(5)]
            for _, writer in peers:
                writer.write(first)
            await wait_until(lambda: len(coordinator._tls_pending) == 5, 5, "5 peers pending")
            good = await _connect(coordinator, tls.client_context(str(tls_files.ca)))
            await good.close()
            assert len(started) == 1  # the agent's; none for a hello not yet whole
            for _, writer in peers:
                writer.write(rest)
            answers = await asyncio.gather(*(reader.read(5) for reader, _ in peers))
            assert all(answer[:1] == b"\x16" for answer in answers)  # the server's flight
            assert len(started) == 6
            for _, writer in peers:
                writer.close()

    run(scenario())


class _HeldTurns(tls_accept.HandshakePace):
    """A pace that holds every handshake turn until :attr:`opened` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = asyncio.Event()

    async def turn(self) -> None:
        await self.opened.wait()


def test_peers_gone_while_their_hellos_wait_for_a_turn_leave_nothing_behind(
    run: Runner, tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that sends its hello and resets while the hello waits for a handshake turn (a
    flood's, say): no handshake starts on its closed connection. One did, and never ended (the
    TLS layer's own timeout does not end a handshake on a connection already lost): each such
    peer kept a task, its TLS state and a slot of the unauthenticated cap for good, and
    uvloop logged an error for each."""

    async def scenario() -> None:
        caplog.set_level(logging.WARNING)
        overrides = {**_server(tls_files), "handshake_timeout": 30}
        async with running_coordinator(**overrides) as coordinator:
            coordinator._handshake_pace = held = _HeldTurns()
            assert coordinator.addresses is not None
            address = coordinator.addresses.host, coordinator.addresses.port
            hello = _client_hello()
            peers = [await asyncio.open_connection(*address) for _ in range(5)]
            for _, writer in peers:
                writer.write(hello)
            await wait_until(lambda: len(coordinator._tls_pending) == 5, 5, "5 hellos waiting")
            waiting = list(coordinator._tls_pending)
            for _, writer in peers:  # a reset (linger 0), not a FIN: the peer is gone
                sock = writer.transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            await wait_until(lambda: all(raw.is_closing() for raw in waiting), 5, "peers gone")
            held.opened.set()
            await wait_until(lambda: not coordinator._tls_pending, 5, "no handshake left")
            good = await _connect(coordinator, tls.client_context(str(tls_files.ca)))
            await good.close()
            assert "tls" not in (coordinator.live.rejected or {})
            assert coordinator.turned_away_lately() == 0

    run(scenario())
    assert [record.getMessage() for record in caplog.records] == []


def test_a_renewed_certificate_is_served_to_new_connections(
    run: Runner, tls_files: TlsFiles, tmp_path: Path
) -> None:
    async def scenario() -> None:
        cert, key = _server_pair_copy(tls_files, tmp_path)
        async with running_coordinator(tls_cert=str(cert), tls_key=str(key)) as coordinator:
            old = await _connect(coordinator, tls.client_context(str(tls_files.ca)), node="old")
            # renewed under another CA: only clients that trust it get through from now on
            shutil.copy(tls_files.other_server_key, key)
            shutil.copy(tls_files.other_server_cert, cert)
            renewed = tls.client_context(str(tls_files.other_ca))
            deadline = time.monotonic() + 10
            while True:
                try:
                    link = await _connect(coordinator, renewed)
                    break
                except HandshakeError:
                    assert time.monotonic() < deadline, "the renewed certificate never served"
                    await asyncio.sleep(0.1)
            try:
                assert (await _levels_for_one_flow(link)).updates == (LevelUpdate(1, 7),)
                with pytest.raises(HandshakeError):  # the old CA no longer verifies it
                    await _connect(coordinator, tls.client_context(str(tls_files.ca)))
                await old.send(Resync(()))  # the live link keeps its session
            finally:
                await link.close()
                await old.close()

    run(scenario())


def test_a_half_renewed_pair_keeps_the_previous_certificate(
    run: Runner, tls_files: TlsFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        cert, key = _server_pair_copy(tls_files, tmp_path)
        async with running_coordinator(tls_cert=str(cert), tls_key=str(key)) as coordinator:
            shutil.copy(tls_files.other_server_cert, cert)  # the key not yet: a mismatched pair
            deadline = time.monotonic() + 10
            while "kept the previous TLS settings" not in caplog.text:  # files checked at connects
                assert time.monotonic() < deadline, "the mismatched pair was never noticed"
                link = await _connect(coordinator, tls.client_context(str(tls_files.ca)))
                await link.close()
                await asyncio.sleep(0.1)
            link = await _connect(coordinator, tls.client_context(str(tls_files.ca)))
            await link.close()

    run(scenario())


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"tls_cert": "c.pem"}, "tls_key"),
        ({"tls_key": "k.pem"}, "tls_cert"),
        ({"tls_client_ca": "ca.pem"}, "tls_client_ca"),
    ],
)
def test_config_refuses_half_a_tls_setting(settings: dict[str, str], field: str) -> None:
    with pytest.raises(tls.TlsConfigError) as refused:
        CoordinatorConfig(token=TOKEN, policy_factory=object, **settings)  # type: ignore[arg-type]
    assert refused.value.field == field


@pytest.mark.parametrize("field", ["etcd_cacert", "etcd_cert", "etcd_key"])
def test_config_refuses_etcd_tls_files_without_etcd(field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: TLS to etcd"):
        CoordinatorConfig(token=TOKEN, policy_factory=object, **{field: "f.pem"})  # type: ignore[arg-type]


#: the random of a ServerHello that is a HelloRetryRequest (RFC 8446, 4.1.3)
HELLO_RETRY_RANDOM = hashlib.sha256(b"HelloRetryRequest").digest()


class _AnswerRecorder(ssl.SSLObject):
    """The server's TLS object: calls :attr:`answered` whenever one writes its second flight,
    the answer (key exchange and signature) to a hello that follows a HelloRetryRequest."""

    answered: Callable[[], None] = staticmethod(lambda: None)

    @classmethod
    def _create(cls, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, *args: Any,
                **kwargs: Any) -> Any:  # fmt: skip
        created = super()._create(incoming, outgoing, *args, **kwargs)  # type: ignore[misc]
        created.outgoing, created.flights = outgoing, 0
        return created

    def do_handshake(self) -> None:
        before = self.outgoing.pending
        try:
            super().do_handshake()
        finally:
            if self.outgoing.pending > before:
                self.flights += 1
                if self.flights == 2:
                    type(self).answered()


async def _retried_peer(
    address: tuple[str, int],
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A TLS client whose first hello got a HelloRetryRequest; its second hello, unsent."""
    client, incoming, outgoing = _memory_client()
    reader, writer = await asyncio.open_connection(*address)
    writer.write(outgoing.read())
    header = await reader.readexactly(5)
    record = header + await reader.readexactly(int.from_bytes(header[3:5], "big"))
    assert record[11:43] == HELLO_RETRY_RANDOM  # a retry, not a ServerHello
    incoming.write(record)
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return reader, writer, outgoing.read()  # a change cipher spec, then the second hello


def test_second_hellos_after_a_hello_retry_are_answered_a_few_per_turn(
    run: Runner, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer whose first hello offers no key share the coordinator takes gets a cheap
    HelloRetryRequest; its second hello costs the key exchange and the signature. Those went
    from the socket to the TLS layer unpaced: peers sending theirs together were all answered
    in one loop turn (1,000 of them held the loop for up to 2.3 s)."""
    answered: list[int] = []
    turns = _LoopTurns()
    monkeypatch.setattr(
        _AnswerRecorder, "answered", staticmethod(lambda: answered.append(turns.count))
    )

    async def scenario() -> None:
        turns.start()
        async with _paced_coordinator(tls_files) as (coordinator, address):
            assert coordinator._tls is not None
            context = coordinator._tls.current()
            context.set_ecdh_curve("secp384r1")  # not a client's first key share: a retry
            context.sslobject_class = _AnswerRecorder
            peers = [await _retried_peer(address) for _ in range(30)]
            assert answered == []
            for _, writer, second_hello in peers:
                writer.write(second_hello)
            await wait_until(lambda: len(answered) == 30, 10, "every second hello answered")
            # an agent that needs the retry still gets through, over either loop's TLS layer
            await _an_agent_gets_its_levels(coordinator, tls_files)
            assert len(answered) == 31
            for _, writer, _ in peers:
                writer.close()
        assert max(Counter(answered).values()) <= 3, Counter(answered)

    run(scenario())


class _FakeRaw:
    """A raw transport, as far as a :class:`tls_accept.RetryHelloGate` uses one."""

    def __init__(self) -> None:
        self.protocol: object = None
        self.closing = False
        self.aborted = False

    def set_protocol(self, protocol: object) -> None:
        self.protocol = protocol

    def get_protocol(self) -> object:
        return self.protocol

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = self.aborted = True

    def close(self) -> None:
        self.closing = True


class _FakeTlsLayer(asyncio.BufferedProtocol):
    """A TLS layer that keeps what it is given."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.buffer = bytearray(100)
        self.eof = False
        self.lost = False

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.received += self.buffer[:nbytes]

    def eof_received(self) -> bool:
        self.eof = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


def _gate(pace: tls_accept.HandshakePace, held: bytes = b"") -> tuple[Any, _FakeRaw, _FakeTlsLayer]:
    raw, layer = _FakeRaw(), _FakeTlsLayer()
    raw.set_protocol(layer)
    gate = tls_accept.RetryHelloGate(raw, pace, held)  # type: ignore[arg-type]
    gate.install(layer)
    return gate, raw, layer


def test_the_gate_passes_on_the_rest_of_a_handshake_at_once_and_leaves() -> None:
    async def scenario() -> None:
        finished = b"\x17\x03\x03\x00\x02ab"  # a TLS 1.3 client's Finished, encrypted
        gate, raw, layer = _gate(_HeldTurns(), CHANGE_CIPHER_SPEC[:3])
        assert raw.get_protocol() is gate and layer.received == b""
        tls_accept._feed(gate, CHANGE_CIPHER_SPEC[3:] + finished)
        assert layer.received == CHANGE_CIPHER_SPEC + finished
        assert raw.get_protocol() is layer

    asyncio.run(scenario())


def test_the_gate_holds_a_second_hello_until_whole_and_its_turn_came() -> None:
    async def scenario() -> None:
        pace = _HeldTurns()
        first, rest = _split_hello(_client_hello(), 20)
        gate, raw, layer = _gate(pace, CHANGE_CIPHER_SPEC)
        tls_accept._feed(gate, first)
        tls_accept._feed(gate, rest[:-1])
        await asyncio.sleep(0)
        tls_accept._feed(gate, rest[-1:])
        await asyncio.sleep(0)
        assert layer.received == b"" and raw.get_protocol() is gate  # whole, no turn yet
        pace.opened.set()
        await wait_until(lambda: raw.get_protocol() is layer, 5, "the gate left")
        assert layer.received == CHANGE_CIPHER_SPEC + first + rest

    asyncio.run(scenario())


def test_the_gate_cuts_off_a_peer_past_the_early_limit() -> None:
    async def scenario() -> None:
        record = b"\x16\x03\x03\x40\x00" + b"\x01\xff\xff\xff" + bytes((16 << 10) - 4)
        gate, raw, layer = _gate(_HeldTurns())
        tls_accept._feed(gate, record)  # a hello that would never end
        assert not raw.aborted
        tls_accept._feed(gate, record)
        assert raw.aborted and layer.received == b""

    asyncio.run(scenario())


@pytest.mark.parametrize("ending", ["eof", "lost"])
def test_a_peer_gone_while_its_second_hello_waits_is_not_answered(ending: str) -> None:
    async def scenario() -> None:
        pace = _HeldTurns()
        gate, raw, layer = _gate(pace, CHANGE_CIPHER_SPEC + _client_hello())
        if ending == "eof":  # the end of stream waits behind the hello and its turn
            assert gate.eof_received() is True and not layer.eof
        else:
            raw.closing = True
            gate.connection_lost(None)
            assert layer.lost
        pace.opened.set()
        for _ in range(3):
            await asyncio.sleep(0)
        if ending == "eof":
            assert layer.received and layer.eof and raw.closing
        else:
            assert layer.received == b""

    asyncio.run(scenario())


def _refused_without_close_notify(port: int) -> float:
    """A TLS peer that sends a frame the coordinator refuses, then neither answers the
    coordinator's close_notify nor closes: seconds until the coordinator's TCP end closes."""
    client, incoming, outgoing = _memory_client()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        while True:
            sock.sendall(outgoing.read())
            try:
                client.do_handshake()
                break
            except ssl.SSLWantReadError:
                data = sock.recv(65536)
                assert data, "the coordinator closed during the TLS handshake"
                incoming.write(data)
        sock.sendall(outgoing.read())
        client.write(struct.pack(">I", 5) + b"hello")  # no msgpack map: refused at once
        sock.sendall(outgoing.read())
        refused = time.monotonic()
        while sock.recv(65536):  # the error frame and close_notify, never answered
            pass
        return time.monotonic() - refused


def test_a_refused_tls_peer_that_never_answers_close_notify_is_cut_off(
    run: Runner, tls_files: TlsFiles
) -> None:
    """A refused connection's close waits CLOSE_TIMEOUT at most for the peer (the error frame
    saying why), under TLS too: the TLS layer's own shutdown waited 30 s for the peer's
    close_notify, holding the socket past the connection caps (a flood of refused peers
    could spend the descriptors the agents need)."""

    async def scenario() -> None:
        async with running_coordinator(**_server(tls_files)) as coordinator:
            assert coordinator.addresses is not None
            port = coordinator.addresses.port
            held = await asyncio.to_thread(_refused_without_close_notify, port)
            assert held < CLOSE_TIMEOUT + 2.0, f"the socket stayed open {held:.1f} s"

    run(scenario())
