"""The testbed worker in one process on loopback (no namespaces): TP ranks over both paths,
and every failure of a worker thread reaching the journal and so the run's errors."""

from __future__ import annotations

import contextlib
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flowsched import nccl, transfer
from flowsched.nccl import harness
from flowsched.testbed import bench, timezero, worker
from flowsched.testbed.daemons import free_ports, reap, wait_for
from flowsched.testbed.runner import collect
from flowsched.testbed.trace import TpJob, Trace, Transfer

IPS = {"h0": "127.0.0.1", "h1": "127.0.0.1"}


def _trace(iterations: int = 2, layers: int = 3, transfers: list[Transfer] | None = None) -> Trace:
    job = TpJob("tp0", ("h0", "h1"), iterations, layers, 0.001, 4000, experience_host="h1")
    return Trace(1, 2, 25e6, 1.0, 0.5, [job], transfers or [])


class MiniControl:
    """Stands in for the minimal controller: every flow at level 0, progress remembered."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    @contextlib.contextmanager
    def flow(self, t: Transfer | None, **fields: Any) -> Iterator[Any]:
        ignore = lambda *args: None  # noqa: E731
        yield SimpleNamespace(
            id=None if t is None else t.flow_id,
            level=0,
            dscp=0,
            so_priority=0,
            add_listener=ignore,
            remove_listener=ignore,
            progress=ignore,
        )

    def job_progress(self, job: str, step: int) -> None:
        self.steps.append(step)


class AgentControl(worker.AgentClient):
    """Selects the worker's plugin path without an agent to talk to."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def job_progress(self, job: str, step: int) -> None:
        self.steps.append(step)


@pytest.fixture(autouse=True)
def _free_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Receivers on an ephemeral port; the TP listener on a port that was free just now."""
    monkeypatch.setattr(worker, "TRANSFER_PORT", 0)
    monkeypatch.setattr(worker, "TP_PORT", free_ports(1)[0])


def _run_ranks(trace: Trace, controls: dict[str, Any], timeout: float = 10.0) -> worker.Journal:
    """Both hosts' workers, each in a thread, sharing one journal (as collect() pools them)."""
    journal, clock = worker.Journal(), worker.Clock(timezero.TimeZero.after(0.0))
    threads = [
        threading.Thread(
            target=worker.Worker(trace, host, IPS, clock, control, journal).run, args=(timeout,)
        )
        for host, control in controls.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    return journal


def _errors(trace: Trace, journal: worker.Journal) -> list[str]:
    return collect(trace, "fair", [journal.events], {}, [], [0]).errors


def _spans(journal: worker.Journal, kind: str) -> int:
    return sum(e["kind"] == "span" and e["span"] == kind for e in journal.events)


def test_socket_ranks_run_every_layer_of_every_iteration() -> None:
    trace = _trace(iterations=2, layers=3)
    recorder, peer = MiniControl(), MiniControl()
    journal = _run_ranks(trace, {"h0": peer, "h1": recorder})
    assert _errors(trace, journal) == []
    assert (_spans(journal, "collective"), _spans(journal, "iteration")) == (6, 2)
    assert (recorder.steps, peer.steps) == ([0, 1], [])


class FakePlugin:
    """The NCCL plugin as the worker drives it; ``fail_at`` = the post that raises."""

    posts = 0
    fail_at: int | None = None

    def __init__(self, path: object, version: int) -> None:
        self.ctx = SimpleNamespace(finalize=lambda: None)

    def init(self, comm_id: int, traffic_class: int) -> Any:
        return self.ctx

    @classmethod
    def post(cls, buf: object, size: int, timeout: float) -> Any:
        cls.posts += 1
        if cls.posts == cls.fail_at:
            raise harness.PluginError("isend", 3)
        return SimpleNamespace(test=lambda: True)


def _fake_comm() -> Any:
    buffer = SimpleNamespace(release=lambda: None)
    return SimpleNamespace(register=lambda size: buffer, post=FakePlugin.post, close=lambda: None)


@pytest.fixture
def fake_plugin(monkeypatch: pytest.MonkeyPatch) -> type[FakePlugin]:
    """The plugin path with a fake plugin; the ranks' out-of-band link is a socketpair."""
    FakePlugin.posts, FakePlugin.fail_at = 0, None
    monkeypatch.setattr(nccl, "plugin_path", lambda: "libfake.so")
    monkeypatch.setattr(harness, "Plugin", FakePlugin)
    monkeypatch.setattr(worker, "_plugin_pair", lambda ctx, oob: (_fake_comm(), _fake_comm()))
    ends = dict(zip(("h0", "h1"), socket.socketpair(), strict=True))

    def connect(self: worker.Worker, job: TpJob, server: object) -> tuple[Any, Any]:
        return ends[self.host], ends[self.host]

    monkeypatch.setattr(worker.Worker, "_tp_connect", connect)
    monkeypatch.setattr(worker.Worker, "_tp_listener", lambda self, job: None)
    return FakePlugin


def test_plugin_ranks_run_every_layer_of_every_iteration(fake_plugin: type[FakePlugin]) -> None:
    trace = _trace(iterations=2, layers=3)
    recorder = AgentControl()
    journal = _run_ranks(trace, {"h0": AgentControl(), "h1": recorder})
    assert _errors(trace, journal) == []
    assert (_spans(journal, "collective"), _spans(journal, "iteration")) == (6, 2)
    assert (
        recorder.steps == [0, 1] and fake_plugin.posts == 2 * 2 * 3 * 2
    )  # ranks x iterations x layers x (recv, send)


def test_plugin_rank_failure_mid_run_is_an_error(fake_plugin: type[FakePlugin]) -> None:
    """A post that raises on one rank: both ranks' failures reach the run's errors."""
    fake_plugin.fail_at = 5
    trace = _trace(iterations=2, layers=3)
    journal = _run_ranks(trace, {"h0": AgentControl(), "h1": AgentControl()})
    errors = _errors(trace, journal)
    assert any("PluginError" in e and "isend" in e for e in errors), errors
    # the other rank loses its peer in the middle of a collective (closed pipe or socket)
    assert sorted(e.split(":")[0] for e in errors) == [
        "TP job tp0, rank on h0",
        "TP job tp0, rank on h1",
    ]
    assert _spans(journal, "iteration") < 2


@pytest.mark.parametrize("control", [MiniControl, AgentControl], ids=["socket-rank", "plugin-rank"])
def test_failed_tp_rank_reaches_the_errors(
    monkeypatch: pytest.MonkeyPatch, control: Callable[[], Any]
) -> None:
    """The rank's connection (socket path) or its plugin (plugin path) fails to come up."""

    def boom(*args: object) -> Any:
        raise OSError("peer unreachable")

    if control is MiniControl:
        monkeypatch.setattr(worker.Worker, "_tp_connect", boom)
    else:
        monkeypatch.setattr(nccl, "plugin_path", boom)
        pair = socket.socketpair()
        monkeypatch.setattr(worker.Worker, "_tp_connect", lambda self, job, server: pair)
    trace = _trace()
    journal = _run_ranks(trace, {"h0": control()}, timeout=2.0)
    assert _errors(trace, journal) == ["TP job tp0, rank on h0: OSError: peer unreachable"]


def test_failed_receive_is_an_error_but_the_iteration_goes_on() -> None:
    """A transfer that arrived broken still releases the iteration waiting for it."""
    experience = Transfer(7, "experience", "h0", "h1", 0.0, 1000, job="tp0", consumer_step=0)
    trace = _trace(transfers=[experience])
    journal, clock = worker.Journal(), worker.Clock(timezero.TimeZero.after(0.0))
    rank = worker.Worker(trace, "h1", IPS, clock, MiniControl(), journal)
    now = time.monotonic()
    broken = transfer.ReceiveStats(7, 600, 1000, False, "", now, now, now, 0.0, "", "reset")
    receiver = SimpleNamespace(results=queue.Queue[transfer.ReceiveStats]())
    receiver.results.put(broken)
    threading.Thread(target=rank._drain, args=(receiver,), daemon=True).start()
    started = time.monotonic()
    rank._wait_experience(trace.tp_jobs[0], 0)
    assert time.monotonic() - started < 5 and 7 in rank.done
    assert _errors(trace, journal) == ["flow 7: received 600 of 1000 bytes: reset"]


class CountedRequest:
    """Completes on its ``after``-th ``test()``; counts calls made after that."""

    def __init__(self, after: int) -> None:
        self.after, self.calls = after, 0

    def test(self) -> bool:
        self.calls += 1
        return self.calls >= self.after


@pytest.mark.parametrize("poll", ["yield", "sleep0", "sleep:0.0001", "backoff"])
def test_wait_requests_polls_each_request_until_done_and_no_further(poll: str) -> None:
    requests = [CountedRequest(3), CountedRequest(40), CountedRequest(1)]
    worker._wait_requests(list(requests), 5.0, poll)
    assert [r.calls for r in requests] == [3, 40, 1]


def test_default_wait_pauses_only_the_shortest_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between test() passes the default loop sleeps 0 s (the kernel's timer slack), never a
    fixed interval like the former 0.2 ms."""
    slept: list[float] = []
    monkeypatch.setattr(worker.time, "sleep", slept.append)
    worker._wait_requests([CountedRequest(50)], 5.0)
    assert slept == [0] * 49


@pytest.mark.parametrize("poll", ["yield", "backoff"])
def test_wait_requests_times_out_naming_what_is_left(poll: str) -> None:
    never = SimpleNamespace(test=lambda: False)
    with pytest.raises(TimeoutError, match="1 of 2 plugin requests"):
        worker._wait_requests([CountedRequest(1), never], 0.05, poll)


def test_unknown_poll_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="FLOWSCHED_TESTBED_POLL: unknown mode 'spin'"):
        worker._wait_requests([CountedRequest(1)], 1.0, "spin")


def test_a_transfer_that_never_arrives_is_an_error() -> None:
    """The worker stops waiting for its receives at its deadline: the transfers it never got
    are missing from the records, so the run must say which."""
    lost = Transfer(7, "kv", "h0", "h1", 0.0, 1000)
    trace = Trace(1, 2, 25e6, 1.0, 0.5, [], [lost])
    journal = worker.Journal()
    receiver_only = worker.Worker(
        trace, "h1", IPS, worker.Clock(timezero.TimeZero.after(0.0)), MiniControl(), journal
    )
    receiver_only.run(0.3)
    assert _errors(trace, journal) == ["receiver on h1: flows 7 did not arrive within 0.3 s"]


def test_a_thread_still_running_at_the_deadline_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TP rank whose collective never completes: the worker ends at its deadline without the
    job's spans, and says so."""
    release = threading.Event()

    def exchange(sock: socket.socket, size: int, handle: Any) -> None:
        release.wait(30)
        raise OSError("released by the test")

    ours, peer = socket.socketpair()
    monkeypatch.setattr(worker.Worker, "_tp_connect", lambda self, job, server: (ours, ours))
    monkeypatch.setattr(worker.Worker, "_tp_listener", lambda self, job: None)
    monkeypatch.setattr(worker, "_exchange", exchange)
    trace = _trace()
    try:
        journal = _run_ranks(trace, {"h1": MiniControl()}, timeout=0.3)
    finally:
        release.set()
        peer.close()
    assert "TP job tp0, rank on h1: still running after 0.3 s" in _errors(trace, journal)


def test_a_tp_rank_whose_peer_never_comes_stops_the_worker_before_it_is_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ranks connect before the worker says ready (the job starts at time zero): a rank
    that cannot is a TimeoutError naming it, and the worker never says ready."""
    monkeypatch.setattr(worker, "SETUP_WAIT", 0.3)
    release = threading.Event()

    def connect(self: worker.Worker, job: TpJob, server: object) -> Any:
        release.wait(30)
        raise OSError("released by the test")

    monkeypatch.setattr(worker.Worker, "_tp_connect", connect)
    said_ready: list[bool] = []
    rank = worker.Worker(_trace(), "h1", IPS, worker.Clock(), MiniControl(), worker.Journal())
    try:
        with pytest.raises(TimeoutError) as raised:
            rank.run(5.0, lambda: said_ready.append(True))
    finally:
        release.set()
    assert str(raised.value) == "TP job tp0, rank on h1: not connected within 0.3 s"
    assert said_ready == []


def test_flows_wait_for_time_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's threads are started when it says ready, but none sends before the time
    zero it is given afterwards."""
    port = free_ports(1)[0]
    monkeypatch.setattr(worker, "TRANSFER_PORT", port)
    ips = {"h0": "127.0.0.1", "h1": "127.0.0.2"}
    first = Transfer(1, "kv", "h0", "h1", 0.0, 1000)
    trace = Trace(1, 2, 25e6, 1.0, 0.5, [], [first])
    clock, journal = worker.Clock(), worker.Journal()
    sender = worker.Worker(trace, "h0", ips, clock, MiniControl(), journal)
    ready, go = threading.Event(), threading.Event()

    def at_ready() -> None:
        ready.set()
        go.wait(30)

    with transfer.Receiver((ips["h1"], port)) as receiver:
        thread = threading.Thread(target=sender.run, args=(10.0, at_ready), daemon=True)
        thread.start()
        assert ready.wait(30)
        zero = timezero.TimeZero.after(0.2)
        clock.start(zero)
        go.set()
        stats = receiver.results.get(timeout=30)
        thread.join(30)
    assert stats.ok and stats.flow_id == 1
    assert stats.started * 1e9 >= zero.ns, "the flow was sent before time zero"
    assert [e["kind"] for e in journal.events if e["kind"] in ("open", "error")] == ["open"]


#: the worker as the runner starts it, on loopback with a receiver on an ephemeral port and a
#: short wait for time zero
_WORKER = (
    "import sys\n"
    "from flowsched.testbed import timezero, worker\n"
    "worker.TRANSFER_PORT = 0\n"
    "timezero.START_WAIT = 0.3\n"
    "raise SystemExit(worker.main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize(
    ("stdin", "status", "problem"),
    [
        ("time zero", 0, None),
        ("nothing", 1, "NoTimeZero: no time zero within 0.3 s"),
        ("closed", 1, "NoTimeZero: stdin ended before time zero came (the runner is gone)"),
        ("garbage", 1, "NoTimeZero: time zero: t0_ns: expected an integer, got None"),
    ],
)
def test_the_worker_says_ready_then_waits_for_time_zero(
    tmp_path: Path,
    silent_controller: tuple[tuple[str, int], queue.Queue[socket.socket]],
    stdin: str,
    status: int,
    problem: str | None,
) -> None:
    """Its first stdout line is its ready line; then it runs from the time zero on its stdin,
    or, without one, gives up on its own with status 1, saying why."""
    (address, port), _ = silent_controller
    trace_path = tmp_path / "trace.json"
    trace_path.write_text(_trace().to_json(), encoding="utf-8")
    out = tmp_path / "h2.json"
    argv = [
        "--trace", str(trace_path), "--host", "h2", "--ips", '{"h2": "127.0.0.1"}',
        "--policy", str(bench.policy_path("fair")), "--control", "mini",
        "--ctl", f"{address}:{port}", "--timeout", "5", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", _WORKER, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        assert proc.stdout.readline() == b"ready\n"
        if stdin == "time zero":
            proc.stdin.write(timezero.TimeZero.after(0.05).line())
        elif stdin == "garbage":
            proc.stdin.write(b'{"t0_wall": 1.0}\n')
        if stdin != "nothing":
            proc.stdin.close()
        code = proc.wait(timeout=30)
        stderr = proc.stderr.read().decode()
    finally:
        reap(proc)
    assert code == status, stderr
    assert (problem is None and stderr == "") or stderr == f"worker on h2: {problem}\n"
    assert out.exists()  # the journal, written in every case


def test_an_iteration_whose_experience_never_arrives_goes_on_with_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker, "EXPERIENCE_WAIT", 0.2)
    experience = Transfer(7, "experience", "h0", "h1", 0.0, 1000, job="tp0", consumer_step=0)
    trace = _trace(transfers=[experience])
    journal = worker.Journal()
    rank = worker.Worker(
        trace, "h1", IPS, worker.Clock(timezero.TimeZero.after(0.0)), MiniControl(), journal
    )
    rank._wait_experience(trace.tp_jobs[0], 0)
    assert _errors(trace, journal) == [
        "TP job tp0, iteration 0 on h1: its experience (flows 7) did not arrive within 0.2 s;"
        " it went on without it"
    ]


@pytest.fixture
def silent_controller() -> Iterator[tuple[tuple[str, int], queue.Queue[socket.socket]]]:
    """A minimal controller's address that accepts and never answers; its connections."""
    accepted: queue.Queue[socket.socket] = queue.Queue()
    with socket.create_server(("127.0.0.1", 0)) as server:

        def accept() -> None:
            with contextlib.suppress(OSError):
                accepted.put(server.accept()[0])

        threading.Thread(target=accept, daemon=True).start()
        yield server.getsockname(), accepted


def test_a_flow_without_a_level_from_the_controller_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
    silent_controller: tuple[tuple[str, int], queue.Queue[socket.socket]],
) -> None:
    """A flow the minimal controller never answers goes out at level 0, the top: the run's
    admission and level figures are not the policy's, and the run must say so."""
    monkeypatch.setattr(worker, "FIRST_LEVEL_WAIT", 0.2)
    address, accepted = silent_controller
    journal = worker.Journal()
    client = worker.MiniClient(address, [], journal)
    with accepted.get(timeout=10), client.flow(Transfer(7, "kv", "h0", "h1", 0.0, 1000)):
        pass
    assert _errors(_trace(), journal)[0] == (
        "flow 7: no level from the testbed controller within 0.2 s; sent at level 0"
    )


def test_a_controller_that_closes_its_connection_is_an_error(
    silent_controller: tuple[tuple[str, int], queue.Queue[socket.socket]],
) -> None:
    """The minimal controller died: every later level change of the host's flows is lost."""
    address, accepted = silent_controller
    journal = worker.Journal()
    worker.MiniClient(address, [], journal)
    accepted.get(timeout=10).close()
    wait_for(lambda: journal.events, 10, "the reader's error")
    assert _errors(_trace(), journal) == [
        "the testbed controller's connection: closed by the controller during the run"
    ]


@pytest.mark.usefixtures("fresh_sdk_connections")
def test_the_agent_client_connects_before_the_first_flow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK would connect on the first flow: the first transfer's admission would then
    include the connection to the agent. The worker's client connects when it is made."""
    path = tmp_path / "agent.sock"
    monkeypatch.setenv("FLOWSCHED_SOCKET", str(path))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as agent:
        agent.bind(str(path))
        agent.listen(1)
        agent.settimeout(10)
        worker.AgentClient(worker.Clock(), worker.Journal())
        connection, _ = agent.accept()
        connection.close()


@pytest.mark.usefixtures("fresh_sdk_connections")
def test_a_worker_without_its_agent_fails_naming_the_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No agent: the SDK would run every flow at its static default; the worker refuses."""
    path = tmp_path / "agent.sock"
    monkeypatch.setenv("FLOWSCHED_SOCKET", str(path))
    with pytest.raises(RuntimeError) as raised:
        worker.AgentClient(worker.Clock(), worker.Journal())
    assert str(raised.value) == f"no connection to the agent at {path}"
