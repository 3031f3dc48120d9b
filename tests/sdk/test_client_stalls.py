"""The SDK client against a scripted agent that is slow, stalled or late: no call waits on it
for long, and no flow is left open at the agent that nobody will close (audit H1, H2, M1)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from polling import child_exit_code

from flowsched import client
from flowsched.agent.threaded import AgentThread
from flowsched.protocol import sdk

#: seconds a test waits for a condition before it fails
WAIT = 10.0


def _wait(predicate: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not reached within {WAIT} s: {what}")
        time.sleep(0.005)


class ScriptedAgent:
    """A unix socket serving one SDK client at a time: it answers ``open`` with ``opened``
    (ids from 100) after ``answer_delay`` seconds, unless ``answer`` is False; with ``stall``
    set it stops reading once it has answered an open. Every message read is in ``seen``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.answer = True
        self.answer_delay = 0.0
        self.stall = False
        self.seen: list[sdk.SdkMessage] = []
        self._ids = iter(range(100, 10**6))
        self._release = threading.Event()  # ends a stall
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, message: sdk.SdkMessage) -> None:
        """Send ``message`` to the client now (an ``opened`` nobody asked for, say)."""
        self._conn.sendall(sdk.encode(message))

    def closes(self) -> list[int]:
        """Flow ids the client closed."""
        return [m.id for m in list(self.seen) if isinstance(m, sdk.Close)]

    def stop(self) -> None:
        self._release.set()
        self._server.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conn = conn
            with conn:
                self._serve_one(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        decoder = sdk.SdkDecoder("agent")
        while data := conn.recv(65536):
            decoder.feed(data)
            while (message := decoder.next_message()) is not None:
                self.seen.append(message)
                if isinstance(message, sdk.Open) and self.answer:
                    threading.Timer(self.answer_delay, self._opened, (conn, message.ref)).start()
                    if self.stall:
                        self._release.wait()
                        return

    def _opened(self, conn: socket.socket, ref: int) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(sdk.encode(sdk.Opened(ref, next(self._ids), 3, 26, 2)))


@pytest.fixture
def scripted(tmp_path: Path, fresh_sdk_connections: None) -> Iterator[ScriptedAgent]:
    agent = ScriptedAgent(str(tmp_path / "agent.sock"))
    try:
        yield agent
    finally:
        agent.stop()


def _in_thread(calls: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=calls, daemon=True)
    thread.start()
    return thread


def test_a_stalled_agent_never_blocks_progress_close_or_job_progress(
    scripted: ScriptedAgent, caplog: pytest.LogCaptureFixture
) -> None:
    scripted.stall = True
    handle = client.open_flow("kv", bytes=1 << 40, socket_path=scripted.path)
    assert handle.id == 100  # answered; the agent reads nothing more from here on
    other = client.open_flow("bulk", socket_path=scripted.path)
    assert not other.connected  # the queue holds its open: not waited for

    def report() -> None:
        for sent in range(1, 100_001):
            handle.progress(sent)  # coalesced while queued: the queue stays small
        for step in range(50_000):  # ~120 bytes a frame: past the queue's limit
            client.job_progress("j" * 100, step, socket_path=scripted.path)
        handle.close()

    with caplog.at_level(logging.WARNING, "flowsched.client"):
        reporter = _in_thread(report)
        reporter.join(WAIT)
        assert not reporter.is_alive(), "an SDK call blocked on the stalled agent"
    assert "has not read" in caplog.text and "giving the connection up" in caplog.text


def test_a_late_opened_is_taken_by_the_handle(
    scripted: ScriptedAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "OPEN_TIMEOUT", 0.05)
    scripted.answer_delay = 0.3
    handle = client.open_flow("kv", bytes=1000, socket_path=scripted.path)
    assert not handle.connected  # open gave up waiting
    handle.progress(600)
    _wait(lambda: handle.id == 100, "the late opened adopted")
    assert (handle.level, handle.dscp, handle.so_priority) == (3, 26, 2)
    _wait(lambda: sdk.Progress(100, 600) in scripted.seen, "its progress sent")
    handle.close()
    _wait(lambda: scripted.closes() == [100], "closed at the agent")


def test_an_opened_for_a_closed_handle_or_nobody_closes_its_flow(
    scripted: ScriptedAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "OPEN_TIMEOUT", 0.05)
    scripted.answer_delay = 0.3
    with client.flow("kv", bytes=1000, socket_path=scripted.path) as handle:
        assert not handle.connected
    _wait(lambda: scripted.closes() == [100], "the late flow of a closed handle closed")
    scripted.send(sdk.Opened(9999, 555, 1, 46, 6))  # a ref this client never sent
    _wait(lambda: scripted.closes() == [100, 555], "an unknown flow closed")
    assert handle.id is None


def test_add_bytes_counts_every_call_of_every_thread() -> None:
    handle = client.FlowHandle(client.FlowClass.BULK, None)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        threads = [
            _in_thread(lambda: [handle.add_bytes(1) for _ in range(20_000)]) for _ in range(4)
        ]
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert handle._sent == 80_000


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda h: h.progress(2**64), "sent must be a byte count"),
        (lambda h: h.progress(-1), "sent must be a byte count"),
        (lambda h: h.add_bytes(-5), "nbytes must be a byte count"),
        (lambda h: (h.progress(2**64 - 1), h.add_bytes(1)), "the total of add_bytes"),
        (lambda h: h.progress(float("inf")), "sent must be a byte count"),
        (lambda h: h.progress(float("nan")), "sent must be a byte count"),
        (lambda h: h.add_bytes(float("-inf")), "nbytes must be a byte count"),
        (lambda h: h.progress(None), "sent must be a byte count"),
        (lambda h: h.progress(3.7), "sent must be a byte count"),  # was cut to 3
        (lambda h: h.progress("12"), "sent must be a byte count"),  # was read as 12
        (lambda h: h.add_bytes(True), "nbytes must be a byte count"),
    ],
    ids=[
        "beyond-u64",
        "negative",
        "negative-add",
        "total",
        "inf",
        "nan",
        "-inf-add",
        "none",
        "fraction",
        "string",
        "bool",
    ],
)
def test_byte_counts_out_of_range_raise_and_leave_the_flow_closable(
    scripted: ScriptedAgent, call: Callable[[client.FlowHandle], object], words: str
) -> None:
    handle = client.open_flow("kv", socket_path=scripted.path)
    with pytest.raises(ValueError, match=words):
        call(handle)
    handle.close()
    _wait(lambda: scripted.closes() == [100], "the flow closed")


def test_a_deadline_too_large_for_a_float_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="deadline"):
        client.open_flow("kv", deadline=10**400, socket_path=str(tmp_path / "none"))


def _open_in_child(path: str, write_end: int) -> None:
    """In a forked child: open, report and close a flow; write its id (or -1) and exit."""
    try:
        with client.flow("experience", bytes=10, socket_path=path) as handle:
            os.write(write_end, str(handle.id if handle.connected else -1).encode())
    finally:
        os._exit(0)


def test_a_forked_child_uses_its_own_connection(agent: AgentThread) -> None:
    path = agent.ready.socket  # type: ignore[union-attr]
    registry = agent.agent.registry
    assert registry is not None
    parent = client.open_flow("kv", bytes=1000, socket_path=path)
    assert parent.connected
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        _open_in_child(path, write_end)
    os.close(write_end)
    child_id = int(os.read(read_end, 64) or b"-2")
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert child_id > 0, "the child's open was not answered (it used its parent's socket)"
    _wait(lambda: child_id not in registry.sdk, "the child's flow closed when it exited")
    assert registry.sdk[parent.id].pid == os.getpid()  # type: ignore[index]
    parent.progress(400)  # the parent's connection is intact
    _wait(lambda: registry.flows[parent.id].sent == 400, "the parent's progress")  # type: ignore[index]
    parent.close()


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda h: h.progress(10), id="progress"),
        pytest.param(lambda h: h.add_bytes(10), id="add_bytes"),
        pytest.param(lambda h: h.add_listener(print), id="add_listener"),
        pytest.param(lambda h: h.close(), id="close"),
    ],
)
def test_a_forked_child_can_use_a_handle_whose_lock_a_parent_thread_held(
    agent: AgentThread, use: Callable[[client.FlowHandle], object]
) -> None:
    """A fork while another thread of the parent held a handle's lock (its reader thread
    giving the handle a new level, or a thread reporting progress) left the child a lock that
    nobody would release: its first call on the inherited handle hung for good."""
    path = agent.ready.socket  # type: ignore[union-attr]
    handle = client.open_flow("kv", bytes=1000, socket_path=path)
    assert handle.connected
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with handle._lock:
            holding.set()
            release.wait(WAIT)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(WAIT)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                use(handle)
                code = 0
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    assert child_exit_code(pid, WAIT) == 0, "the child hung on the handle's inherited lock"
    registry = agent.agent.registry
    assert registry is not None and handle.id in registry.sdk  # the parent's flow is intact
    handle.close()


def test_progress_dropped_for_a_close_leaves_no_queued_bytes_counted() -> None:
    # a progress queued behind a slow agent and then made moot by its flow's close is never
    # sent: the bytes counted for it must leave the count too, or a healthy connection's
    # count grows with every such flow until it is given up as stalled
    ours, agents = socket.socketpair()
    with ours, agents:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sender = client._Sender(ours)
        while not sender.backed_up:
            assert sender.send(sdk.JobProgress("j" * 100, 1, None))
        for flow_id in range(1000, 1200):
            assert sender.send(sdk.Progress(flow_id, 5))
            assert sender.send(sdk.Close(flow_id, 5))
        agents.setblocking(False)

        def drained() -> bool:
            with contextlib.suppress(BlockingIOError):
                agents.recv(1 << 16)
            return not sender.backed_up

        _wait(drained, "the agent read every queued frame")
        assert sender._queued == 0
        sender.stop()


#: a process whose SIGPIPE is the default (an embedding application, a CLI that wants ``| head``
#: to end it quietly) writes, through a _Sender, to an agent that went away: a frame sent at
#: once (prints what ``send`` said), or the writer thread's queue (prints whether it ended)
_WRITE_TO_A_GONE_AGENT = """
import signal, socket, sys, threading
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
from flowsched import client
from flowsched.protocol import sdk

ours, agents = socket.socketpair()
ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
sender = client._Sender(ours)
if sys.argv[1] == "writer":  # the writer thread is in sendall when the agent goes
    while not sender.backed_up:
        sender.send(sdk.JobProgress("j" * 100, 1, None))
    # found now: once the agent is gone it may end before it could be looked up
    writer = next(t for t in threading.enumerate() if t.name == "flowsched-sdk-writer")
agents.close()
if sys.argv[1] == "caller":
    print("send gave", sender.send(sdk.JobProgress("j", 2, None)), flush=True)
else:
    writer.join(5)
    print("writer alive", writer.is_alive(), flush=True)
"""


@pytest.mark.parametrize(
    ("where", "said"), [("caller", "send gave False"), ("writer", "writer alive False")]
)
def test_an_agent_gone_never_kills_a_process_whose_sigpipe_is_the_default(
    where: str, said: str
) -> None:
    """The SDK's writes carry MSG_NOSIGNAL, as the plugin's do: a process that left SIGPIPE at
    its default (Python ignores it, an embedding program may not) is not killed by the write
    that finds its agent gone."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _WRITE_TO_A_GONE_AGENT, where],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip() == said  # the connection given up, as for any other error
