"""flowsched.transfer over loopback: byte-exact delivery, marking, promotions, corruption."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from polling import wait_until

from flowsched import transfer
from flowsched.testbed.daemons import closed_port

#: a Receiver in a process of its own whose open-file limit is 64; prints its port
_LIMITED_RECEIVER = """
import resource, threading
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from flowsched import transfer
print(transfer.Receiver(("127.0.0.1", 0)).start().address[1], flush=True)
threading.Event().wait()
"""


class FakeHandle:
    """A flow handle whose level the test changes (as the SDK's reader thread would)."""

    def __init__(self, level: int, dscp: int, so_priority: int = 0) -> None:
        self.level, self.dscp, self.so_priority = level, dscp, so_priority
        self.id: int | None = 42
        self.listeners: list[Callable[[FakeHandle], None]] = []
        self.reported: list[int] = []

    def add_listener(self, cb: Callable[[FakeHandle], None]) -> None:
        self.listeners.append(cb)

    def remove_listener(self, cb: Callable[[FakeHandle], None]) -> None:
        self.listeners.remove(cb)

    def progress(self, sent: int) -> None:
        self.reported.append(sent)

    def promote(self, level: int, dscp: int) -> None:
        self.level, self.dscp = level, dscp
        for cb in list(self.listeners):
            cb(self)


@pytest.mark.parametrize("size", [0, 1, 65_537, 3 * 1024 * 1024 + 11], ids=str)
def test_pattern_payload_arrives_byte_exact(size: int) -> None:
    with transfer.Receiver() as rx:
        stats = transfer.send_flow(rx.address, size, seed=7, flow_id=9, timeout=10)
        got = rx.results.get(timeout=10)
    assert got.ok and got.bytes == size and got.flow_id == 9
    assert got.digest == stats.digest == transfer.pattern_digest(size, seed=7)


@pytest.mark.parametrize("kind", ["int64", "uint32", "intp"])
@pytest.mark.parametrize("with_flow", [False, True], ids=["send_flow", "send_with_flow"])
def test_a_numpy_integer_size_is_a_size(
    kind: str, with_flow: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``np.int64(n)`` (a size computed with numpy) sends an n-byte pattern, not the scalar's
    own 8 bytes (numpy scalars are buffers too)."""
    np = pytest.importorskip("numpy")
    from flowsched import client

    size = getattr(np, kind)(65_537)
    declared: list[object] = []
    real_open = client.open_flow
    monkeypatch.setattr(
        client, "open_flow", lambda *a, **kw: (declared.append(kw["bytes"]), real_open(*a, **kw))[1]
    )
    with transfer.Receiver() as rx:
        if with_flow:
            no_agent = str(tmp_path / "agent.sock")
            stats = transfer.send_with_flow(rx.address, size, "kv", socket_path=no_agent)
        else:
            stats = transfer.send_flow(rx.address, size, timeout=10)
        got = rx.results.get(timeout=10)
    assert got.ok and got.bytes == stats.bytes == 65_537
    assert got.digest == transfer.pattern_digest(65_537)
    assert declared == ([65_537] if with_flow else [])


def reference_pattern(size: int, seed: int) -> bytes:
    """Block i of the payload is the seed's 1 MiB random block rotated left by i * 4099."""
    import random

    base, out = random.Random(seed).randbytes(1 << 20), bytearray()
    for block in range(-(-size // (1 << 20))):
        shift = block * 4099 % (1 << 20)
        out += (base[shift:] + base[:shift])[: size - len(out)]
    return bytes(out)


@pytest.mark.parametrize("size", [0, 1, 1 << 20, (1 << 20) + 5, 5 * (1 << 20) + 77], ids=str)
@pytest.mark.parametrize("seed", [0, 3])
def test_pattern_is_a_fixed_function_of_size_and_seed(size: int, seed: int) -> None:
    # twice: the second call comes from the cached block and must not differ
    for _ in range(2):
        assert b"".join(transfer.pattern(size, seed)) == reference_pattern(size, seed)


def test_pattern_draws_each_seeds_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    draws: list[int] = []

    class CountingRandom(random.Random):
        def randbytes(self, n: int) -> bytes:
            draws.append(n)
            return super().randbytes(n)

    monkeypatch.setattr(transfer.random, "Random", CountingRandom)
    transfer._pattern_base.cache_clear()
    try:
        for seed in (11, 12, 11, 12, 11):
            b"".join(transfer.pattern(3 << 20, seed))
    finally:
        transfer._pattern_base.cache_clear()
    assert draws == [1 << 20, 1 << 20]  # one per seed, not one per transfer


def test_explicit_bytes_arrive_byte_exact() -> None:
    data = os.urandom(1_000_003)
    with transfer.Receiver() as rx:
        transfer.send_flow(rx.address, data, chunk=4096, timeout=10)
        got = rx.results.get(timeout=10)
    assert got.ok and got.digest == hashlib.sha256(data).hexdigest()


def test_socket_gets_the_flow_marking_and_follows_a_promotion() -> None:
    handle = FakeHandle(level=5, dscp=10, so_priority=1)
    seen_tos: list[int] = []
    halfway = threading.Event()
    promoted = threading.Event()
    original_progress = handle.progress

    def on_progress(sent: int) -> None:
        original_progress(sent)
        if sent >= 4 << 20:
            halfway.set()
            promoted.wait(5)  # hold the sender at a chunk boundary until the promotion landed

    handle.progress = on_progress  # type: ignore[method-assign]
    with transfer.Receiver() as rx:
        sock = socket.create_connection(rx.address)

        def promoter() -> None:  # the SDK's reader thread, in real use
            halfway.wait(5)
            seen_tos.append(sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS))
            handle.promote(0, 46)
            seen_tos.append(sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS))
            promoted.set()

        thread = threading.Thread(target=promoter)
        thread.start()
        try:
            stats = transfer.send_flow(sock, 16 << 20, flow_handle=handle, timeout=10)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) == 1
        finally:
            thread.join(5)
            sock.close()
        assert rx.results.get(timeout=10).ok
    assert seen_tos == [10 << 2, 46 << 2]  # applied by the promoting thread, at once
    assert [level for _, level in stats.levels] == [5, 0]
    assert not handle.listeners  # the sender unregistered its listener


def test_progress_is_reported_to_the_flow() -> None:
    handle = FakeHandle(level=1, dscp=8)
    with transfer.Receiver() as rx:
        transfer.send_flow(rx.address, 5 << 20, flow_handle=handle, report_every=1 << 20)
        assert rx.results.get(timeout=10).ok
    assert handle.reported[-1] == 5 << 20
    assert handle.reported == sorted(handle.reported) and len(handle.reported) >= 5


@pytest.mark.parametrize("payload", [bytes, memoryview], ids=["bytes", "memoryview"])
def test_a_user_buffer_is_sent_and_reported_as_it_goes(payload: type) -> None:
    """Progress every ``report_every`` bytes for a caller's buffer too (it was hashed whole
    before the first byte left, and reported once, at the end)."""
    data = payload(os.urandom(5 << 20))
    handle = FakeHandle(level=1, dscp=8)
    with transfer.Receiver() as rx:
        transfer.send_flow(rx.address, data, flow_handle=handle, report_every=1 << 20)
        got = rx.results.get(timeout=10)
    assert got.ok and got.digest == hashlib.sha256(data).hexdigest()
    assert handle.reported[:5] == [n << 20 for n in range(1, 6)]


@pytest.mark.parametrize("timeout", [None, 7.5], ids=["blocking", "timeout"])
def test_the_callers_socket_keeps_its_timeout(timeout: float | None) -> None:
    with transfer.Receiver() as rx, socket.create_connection(rx.address) as sock:
        sock.settimeout(timeout)
        transfer.send_flow(sock, 100_000, timeout=3)
        assert rx.results.get(timeout=10).ok
        assert sock.gettimeout() == timeout


def test_a_failed_send_leaves_the_callers_socket_blocking() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        sock = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        peer.close()  # the receiver is gone: the send fails
        with sock, pytest.raises(transfer.TransferError):
            transfer.send_flow(sock, 64 << 20, timeout=3)
        assert sock.gettimeout() is None


def test_corrupted_payload_is_detected_and_the_sender_told() -> None:
    with transfer.Receiver() as rx:
        sock = socket.create_connection(rx.address)
        with sock:
            payload = b"x" * 1000
            sock.sendall(transfer.HEADER.pack(transfer.MAGIC, 0, len(payload), 1) + payload)
            sock.sendall(hashlib.sha256(b"y" * 1000).digest())
            assert sock.recv(1) == b"\x00"
        got = rx.results.get(timeout=10)
    assert not got.ok and got.bytes == 1000 and "mismatch" in (got.error or "")


def test_short_transfer_is_reported_as_incomplete() -> None:
    with transfer.Receiver() as rx:
        sock = socket.create_connection(rx.address)
        sock.sendall(transfer.HEADER.pack(transfer.MAGIC, 0, 5000, 1) + b"z" * 100)
        sock.close()
        got = rx.results.get(timeout=10)
    assert not got.ok and got.bytes == 100 and "100/5000 bytes, incomplete" in (got.error or "")


def test_a_receiver_that_closes_without_an_answer_is_not_called_a_corrupt_transfer() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        got: list[int] = []

        def receive_then_close() -> None:
            peer, _ = server.accept()
            with peer:  # takes the whole transfer, then closes without its status byte
                got.append(len(transfer.recv_exact(peer, transfer.HEADER.size + 1000 + 32)))

        thread = threading.Thread(target=receive_then_close)
        thread.start()
        try:
            with pytest.raises(transfer.TransferError, match="closed the connection") as caught:
                transfer.send_flow(server.getsockname(), 1000, timeout=10)
        finally:
            thread.join(timeout=10)
    assert got == [transfer.HEADER.size + 1000 + 32]
    assert "corrupt" not in str(caught.value)


#: a sender in a process whose SIGPIPE is the default (an embedding program, a CLI that wants
#: ``| head`` to end it quietly), to a receiver that takes the connection and closes it
_SEND_TO_A_CLOSED_PEER = """
import signal, socket
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
from flowsched import transfer

with socket.create_server(("127.0.0.1", 0)) as server:
    sock = socket.create_connection(server.getsockname())
    server.accept()[0].close()
    try:
        transfer.send_flow(sock, 16 << 20, timeout=10)
    except transfer.TransferError:
        print("TransferError", flush=True)
"""


def test_a_receiver_gone_is_a_transfer_error_where_sigpipe_is_the_default() -> None:
    """The sender's writes carry MSG_NOSIGNAL: a peer that closes is a TransferError, not
    SIGPIPE ending the whole sending process."""
    done = subprocess.run(
        [sys.executable, "-c", _SEND_TO_A_CLOSED_PEER],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert (done.returncode, done.stdout.strip()) == (0, "TransferError"), done.stderr[-2000:]


def test_a_receiver_that_cannot_bind_closes_its_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError) as caught:
            transfer.Receiver(busy.getsockname()[:2])
        # while the exception (and the frame holding the half-built Receiver) is alive
        assert set(os.listdir("/proc/self/fd")) - before == set()
        del caught


def test_bad_magic_is_rejected() -> None:
    with transfer.Receiver() as rx:
        with socket.create_connection(rx.address) as sock:
            sock.sendall(b"HTTP" + bytes(20))
        got = rx.results.get(timeout=10)
    assert not got.ok and "magic" in (got.error or "")


def test_the_receiver_keeps_accepting_after_running_out_of_descriptors() -> None:
    child = subprocess.Popen([sys.executable, "-c", _LIMITED_RECEIVER], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        with contextlib.ExitStack() as held:
            for _ in range(100):  # more than its descriptors: its accepts fail (EMFILE)
                held.enter_context(socket.create_connection(("127.0.0.1", port)))
            wait_until(lambda: len(os.listdir(f"/proc/{child.pid}/fd")) == 64)
        # they left: the next sender is served (the accept thread used to end at the
        # first failed accept, and the port stayed dead)
        assert transfer.send_flow(("127.0.0.1", port), 1 << 20, timeout=10).bytes == 1 << 20
    finally:
        child.kill()
        child.wait(timeout=10)


def test_connections_beyond_the_receivers_cap_are_closed_at_once() -> None:
    with transfer.Receiver(max_connections=2) as rx, contextlib.ExitStack() as held:
        for _ in range(2):  # silent peers holding both of its connections
            held.enter_context(socket.create_connection(rx.address))
        # closed unread: the sender sees the end, a reset or a broken pipe, and no
        # acknowledgement
        with pytest.raises(transfer.TransferError, match=r"closed the connection|reset|pipe"):
            transfer.send_flow(rx.address, 1000, timeout=10)
        held.close()
        wait_until(lambda: rx.results.qsize() == 2)  # their slots are free again
        assert transfer.send_flow(rx.address, 1000, timeout=10).bytes == 1000


def test_unreachable_receiver_is_a_transfer_error() -> None:
    with closed_port() as port, pytest.raises(transfer.TransferError, match="cannot connect"):
        transfer.send_flow(("127.0.0.1", port), 10, timeout=2)


def test_marker_sets_ipv6_traffic_class() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError as exc:
        pytest.skip(f"cannot create an IPv6 socket: {exc}")
    with sock:
        transfer.SocketMarker(sock).apply(0, 46, 0)
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS) == 46 << 2


def test_agent_promotion_reaches_a_transfer_socket(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from flowsched import client
    from flowsched.agent import AgentConfig
    from flowsched.agent.threaded import AgentThread

    config = AgentConfig(node="n1", socket_path=str(tmp_path / "agent.sock"),
                         table_path=str(tmp_path / "table"), num_slots=8, metrics_port=None,
                         fallback_after=60.0, interfaces=("lo",))  # fmt: skip
    seen: list[int] = []
    with AgentThread(config) as agent, transfer.Receiver() as rx:
        try:
            with client.flow("kv", socket_path=config.socket_path) as handle:
                halfway, done = threading.Event(), threading.Event()
                report = handle.progress

                def on_progress(sent: int) -> None:
                    report(sent)
                    if sent >= 2 << 20 and not done.is_set():
                        halfway.set()
                        done.wait(5)

                handle.progress = on_progress  # type: ignore[method-assign]
                sock = socket.create_connection(rx.address)

                def promote() -> None:
                    halfway.wait(5)
                    agent.run(lambda: agent.agent.apply_levels([(handle.id, 0)]))
                    end = time.monotonic() + 3
                    while handle.level != 0 and time.monotonic() < end:
                        time.sleep(0.005)
                    seen.append(sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS))
                    done.set()

                thread = threading.Thread(target=promote)
                thread.start()
                with sock:
                    transfer.send_flow(sock, 8 << 20, flow_handle=handle, timeout=10)
                thread.join(5)
            assert rx.results.get(timeout=10).ok
        finally:
            conn = client._connections.pop(config.socket_path, None)
            if conn is not None:
                conn.close()
    assert seen == [agent.agent.view.marking(0).dscp << 2]


class _NoPrioritySocket:
    """A socket stand-in whose SO_PRIORITY needs a capability we do not have."""

    family = socket.AF_INET

    def __init__(self) -> None:
        self.options: dict[tuple[int, int], int] = {}

    def setsockopt(self, level: int, name: int, value: int) -> None:
        if name == socket.SO_PRIORITY and value > 6:
            raise PermissionError(1, "Operation not permitted")
        self.options[level, name] = value


def test_priority_without_capability_keeps_the_dscp(caplog: pytest.LogCaptureFixture) -> None:
    fake = _NoPrioritySocket()
    marker = transfer.SocketMarker(fake)  # type: ignore[arg-type]
    marker.apply(0, 46, 7)
    marker.apply(1, 34, 9)
    assert fake.options[socket.IPPROTO_IP, socket.IP_TOS] == 34 << 2
    assert [level for _, level in marker.applied] == [0, 1]
    assert sum("CAP_NET_ADMIN" in r.getMessage() for r in caplog.records) == 1


def test_marker_sets_the_tos_of_an_ipv6_socket_with_an_ipv4_peer() -> None:
    """A socket accepted on a dual-stack listener carries IPv4 packets: their TOS is IP_TOS."""
    try:
        server = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError) as exc:
        pytest.skip(f"no dual-stack IPv6 socket here: {exc}")
    with server, socket.create_connection(("127.0.0.1", server.getsockname()[1])):
        accepted, peer = server.accept()
        with accepted:
            assert peer[0] == "::ffff:127.0.0.1"  # a v4-mapped peer
            transfer.SocketMarker(accepted).apply(0, 46, 0)
            assert accepted.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 46 << 2


def test_a_marking_change_that_comes_late_leaves_the_callers_socket_alone() -> None:
    """The SDK's reader thread calls the listeners it copied before ``send_flow`` removed its
    own: one that runs after ``send_flow`` returned must not mark the caller's socket, which by
    then may carry the next transfer (of another flow, at another marking)."""
    handle = FakeHandle(level=5, dscp=10)
    removed: list[Callable[[FakeHandle], None]] = []
    remove = handle.remove_listener
    handle.remove_listener = lambda cb: (removed.append(cb), remove(cb))  # type: ignore[method-assign]
    with transfer.Receiver() as rx, socket.create_connection(rx.address) as sock:
        transfer.send_flow(sock, 1000, flow_handle=handle, timeout=5)
        assert rx.results.get(timeout=10).ok
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 46 << 2)  # the next transfer's
        handle.level, handle.dscp = 0, 34
        removed[0](handle)  # the reader thread, late
        assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 46 << 2
