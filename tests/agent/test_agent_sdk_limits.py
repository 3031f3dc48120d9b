"""The agent's SDK socket under one user's load (audit M1, M5, H4) and the resync deadline
(audit M6): caps per uid and per node, an idle timeout that spares clients holding flows, the
open-file limit, and request names scoped like job names."""

from __future__ import annotations

import array
import asyncio
import contextlib
import grp
import logging
import os
import resource
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
from agent_helpers import agent_config, lingering_tcp_socket, wait_until
from polling import child_exit_code

from flowsched import client, fdlimit
from flowsched.agent import sdk_server
from flowsched.agent.config import AgentConfig
from flowsched.agent.flows import FlowRegistry
from flowsched.agent.service import Agent
from flowsched.agent.threaded import AgentThread
from flowsched.agent.turns import MESSAGES_PER_TURN
from flowsched.model import FlowClass
from flowsched.protocol import PROTOCOL_VERSION, Welcome, sdk
from flowsched.testbed.sdk_flood import FLOOD_CONNECTIONS, NOBODY, flooding, shareable_group

UID = os.geteuid()


@pytest.fixture
def agent(tmp_path: Path, fresh_sdk_connections: None) -> Iterator[AgentThread]:
    with AgentThread(agent_config(tmp_path, metrics_port=None, fallback_after=60.0)) as running:
        yield running


def _sdk(agent: AgentThread) -> sdk_server.SdkServer:
    assert agent.agent.sdk is not None
    return agent.agent.sdk


def _raw(agent: AgentThread) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(agent.ready.socket)  # type: ignore[union-attr]
    return sock


def _ask(sock: socket.socket, message: sdk.SdkMessage) -> sdk.SdkMessage:
    sock.sendall(sdk.encode(message))
    return _next(sock)


def _next(sock: socket.socket) -> sdk.SdkMessage:
    decoder = sdk.SdkDecoder("client")
    while (message := decoder.next_message()) is None:
        data = sock.recv(65536)
        assert data, "the agent closed the connection"
        decoder.feed(data)
    return message


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_the_flow_cap_is_per_uid_across_connections(agent: AgentThread) -> None:
    agent.run(lambda: setattr(_sdk(agent), "max_flows_per_uid", 3))
    first, second = _raw(agent), _raw(agent)
    answers = [_ask(sock, sdk.Open(ref, "bulk")) for ref, sock in enumerate((first, second) * 2)]
    assert [type(a).__name__ for a in answers] == ["Opened", "Opened", "Opened", "Error"]
    refused = answers[-1]
    assert isinstance(refused, sdk.Error) and refused.code == "too_many_flows"
    assert "per user" in refused.reason and refused.ref == 3
    closed = answers[0]
    assert isinstance(closed, sdk.Opened)
    first.sendall(sdk.encode(sdk.Close(closed.id, 0)))  # a closed flow makes room
    assert isinstance(_ask(second, sdk.Open(9, "bulk")), sdk.Opened)
    first.close()  # and so do the flows of a client that leaves
    wait_until(lambda: _sdk(agent)._flows_of[UID] == 2)


def test_the_node_wide_flow_cap(agent: AgentThread) -> None:
    agent.run(lambda: setattr(_sdk(agent), "max_flows", 1))
    sock = _raw(agent)
    assert isinstance(_ask(sock, sdk.Open(1, "bulk")), sdk.Opened)
    refused = _ask(sock, sdk.Open(2, "bulk"))
    assert isinstance(refused, sdk.Error) and "on this node" in refused.reason


def test_connections_over_the_per_uid_cap_are_refused_and_the_client_says_why(
    agent: AgentThread, caplog: pytest.LogCaptureFixture
) -> None:
    agent.run(lambda: setattr(_sdk(agent), "max_connections_per_uid", 1))
    held = _raw(agent)
    assert isinstance(_ask(held, sdk.Open(1, "bulk")), sdk.Opened)
    extra = _raw(agent)
    refusal = _next(extra)
    assert isinstance(refusal, sdk.Error) and refusal.code == "too_many_connections"
    assert _closed(extra)
    with caplog.at_level(logging.WARNING):
        path = agent.ready.socket  # type: ignore[union-attr]
        with client.flow("bulk", socket_path=path) as handle:
            assert not handle.connected  # static defaults, as with no agent
        # the client's reader thread logs the agent's reason when it reads the refusal
        wait_until(lambda: "refused the connection (too_many_connections)" in caplog.text)
    assert "SDK connection of pid" in caplog.text  # the agent logs the refusal
    held.close()
    wait_until(lambda: _sdk(agent).clients == 0)
    with client.flow("bulk", socket_path=path) as handle:  # room again
        wait_until(lambda: handle.connected or client.connection(path).ensure_connected())


def test_the_total_connection_cap_stays_below_the_open_file_limit() -> None:
    server = sdk_server.SdkServer(None, fd_limit=4096)  # type: ignore[arg-type]
    # room for the agent's own descriptors, and for those waiting for the closer thread (the
    # most it lets wait, and what one more read may bring)
    unclosed = sdk_server.MAX_UNCLOSED + sdk_server.SCM_MAX_FD
    assert server.max_connections == 4096 - sdk_server.FD_RESERVE - unclosed
    assert sdk_server.SdkServer(None).max_connections == sdk_server.MAX_CONNECTIONS  # type: ignore[arg-type]


def test_an_idle_client_is_closed_but_not_one_holding_a_flow(agent: AgentThread) -> None:
    agent.run(lambda: setattr(_sdk(agent), "idle_timeout", 0.2))
    holder = _raw(agent)
    opened = _ask(holder, sdk.Open(1, "bulk"))
    assert isinstance(opened, sdk.Opened)
    for _ in range(3):  # three idle timeouts pass while the holder stays silent
        assert _closed(_raw(agent))
    assert _sdk(agent).clients == 1
    holder.sendall(sdk.encode(sdk.Progress(opened.id, 7)))
    registry = agent.agent.registry
    assert registry is not None
    wait_until(lambda: registry.flows[opened.id].sent == 7)
    holder.sendall(sdk.encode(sdk.Close(opened.id, 7)))  # no flow left: idle from now on
    assert _closed(holder)


def _released(sock: socket.socket) -> bool:
    """Whether the agent let go of its end of ``sock``: the client sees the hang-up before it
    reads any of what was queued for it (an agent end that waits to send it holds on)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return any(events & select.POLLHUP for _, events in poller.poll(0))


def _send_unread(sock: socket.socket, messages: list[sdk.SdkMessage]) -> threading.Thread:
    """Send ``messages`` from a thread and read none of the answers (the agent may stop
    reading them: the send then fails or times out)."""

    def send() -> None:
        with contextlib.suppress(OSError):
            sock.sendall(b"".join(sdk.encode(message) for message in messages))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _refusal_size() -> int:
    reason = f"at most {sdk_server.MAX_FLOWS_PER_UID} open SDK flows per user on a node"
    return len(sdk.encode(sdk.Error("too_many_flows", reason, 99999)))


def test_a_client_that_reads_nothing_is_dropped_at_once_and_logged_once(
    agent: AgentThread, caplog: pytest.LogCaptureFixture
) -> None:
    server = _sdk(agent)
    agent.run(lambda: setattr(server, "max_flows_per_uid", 1))
    sock = _raw(agent)
    assert isinstance(_ask(sock, sdk.Open(0, "bulk")), sdk.Opened)  # a flow: never idle
    refusals = 3 * sdk_server.MAX_CLIENT_BACKLOG // _refusal_size()
    with caplog.at_level(logging.WARNING, logger="flowsched.agent.sdk"):
        _send_unread(sock, [sdk.Open(ref, "bulk") for ref in range(1, refusals)])
        # dropped: its queued answers (over 1 MiB) and its socket are freed now, not kept
        # for as long as the client keeps its end open without reading
        wait_until(lambda: _released(sock), timeout=10)
        wait_until(lambda: server.clients == 0)  # its flow closed with it
    assert caplog.text.count("is not reading") == 1  # not once per answer it did not read


def test_a_connection_closed_as_idle_does_not_outlive_its_unread_answers(
    agent: AgentThread,
) -> None:
    server = _sdk(agent)
    agent.run(lambda: setattr(server, "max_flows_per_uid", 0))  # every open refused
    agent.run(lambda: setattr(server, "idle_timeout", 0.5))
    sock = _raw(agent)
    # answers beyond what the socket buffers hold, below the backlog that drops a client
    refusals = sdk_server.MAX_CLIENT_BACKLOG // 2 // _refusal_size()
    _send_unread(sock, [sdk.Open(ref, "bulk") for ref in range(refusals)])
    wait_until(lambda: server.requests["open"] == refusals)
    # the idle timeout ends the connection and it no longer counts toward the user's cap:
    # it must not keep its socket and answers either, or a user could hold any number
    wait_until(lambda: not server._connections_of, timeout=10)
    wait_until(lambda: _released(sock), timeout=5)


def test_bad_frames_are_logged_once_per_user_and_cut_short(
    agent: AgentThread, caplog: pytest.LogCaptureFixture
) -> None:
    body = msgpack.packb({"t": "x" * 60000})  # a type name the agent quotes in its answer
    tries = 20
    with caplog.at_level(logging.WARNING, logger="flowsched.agent.sdk"):
        for _ in range(tries):  # each on a connection of its own: the answer, then the end
            sock = _raw(agent)
            sock.sendall(len(body).to_bytes(4, "big") + body)
            refusal = _next(sock)
            assert isinstance(refusal, sdk.Error) and refusal.code == "bad_frame"
            assert _closed(sock)
        wait_until(lambda: _sdk(agent).errors_total == tries)
    logged = [r.getMessage() for r in caplog.records if "sent a bad frame" in r.getMessage()]
    assert len(logged) == 1  # then at a falling rate: 20 lines of 60 KB each were logged
    assert len(logged[0]) < 500 and "(60037 characters)" in logged[0]


def _somaxconn() -> int:
    """The kernel's cap on a listen backlog."""
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(
    _somaxconn() <= sdk_server.MAX_CONNECTIONS_PER_UID,
    reason="net.core.somaxconn caps the listen backlog below one user's connections",
)
def test_all_the_connections_a_user_may_hold_get_in_at_once_while_the_agent_is_busy(
    agent: AgentThread,
) -> None:
    """A client that finds the listen backlog full fails at once (EAGAIN) and runs on static
    defaults: the backlog was 128, below the 256 connections one user may hold, so one user's
    processes starting together (or a flooding user's) kept others out while the loop was
    busy. It now holds as many as the agent serves."""
    server = _sdk(agent)
    busy, release = threading.Event(), threading.Event()

    def hold_the_loop() -> None:
        busy.set()
        release.wait(10)

    holder = threading.Thread(target=agent.run, args=(hold_the_loop,))
    holder.start()
    socks: list[socket.socket] = []
    try:
        assert busy.wait(10)
        for _ in range(sdk_server.MAX_CONNECTIONS_PER_UID):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setblocking(False)
            sock.connect(agent.ready.socket)  # type: ignore[union-attr]  # BlockingIOError: full
    finally:
        release.set()
        holder.join()
    wait_until(lambda: server._connections_of[UID] == len(socks))
    for sock in socks:
        sock.close()


def _open_on_a_fresh_connection(path: str) -> client.FlowHandle:
    """``client.open_flow`` (which waits :data:`client.OPEN_TIMEOUT` at most for the answer,
    then runs on static defaults) on a new connection: its accept and first read wait for the
    agent's loop too."""
    with contextlib.suppress(KeyError):
        client._connections.pop(path).close()
    return client.open_flow("kv", bytes=1000, deadline=time.time() + 60, socket_path=path)


def _config_nobody_reaches(
    tmp_path: Path, request: pytest.FixtureRequest, who: str
) -> tuple[AgentConfig, str, grp.struct_group]:
    """An agent config whose SDK socket ``nobody`` can reach through a shared group (skips
    when there is none), the socket's path and the group; ``who``: the part nobody plays."""
    group = shareable_group()
    if group is None:
        pytest.skip(f"no group among users/nogroup/daemon/staff to give the {who}")
    reachable = Path(tempfile.mkdtemp(prefix="flowsched-sdk-test-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(reachable, ignore_errors=True))
    reachable.chmod(0o755)  # pytest's tmp_path is under a 0700 directory nobody cannot traverse
    path = str(reachable / "run" / "agent.sock")
    config = agent_config(
        tmp_path, metrics_port=None, fallback_after=60.0, socket_path=path, group=group.gr_name
    )
    return config, path, group


@pytest.mark.skipif(UID != 0, reason="the flood comes from another uid: switching users needs root")
def test_another_users_opens_are_answered_while_one_user_floods_the_agent(
    tmp_path: Path, request: pytest.FixtureRequest, fresh_sdk_connections: None
) -> None:
    """200 connections of one user, each sending opens as fast as the agent takes them, held
    the agent's loop for seconds a turn: another user's client never got an answer within the
    SDK's timeout (and the agent lost its coordinator). Each user now has its share of every
    loop turn (flowsched.agent.turns); the flood is still served, not refused."""
    config, path, group = _config_nobody_reaches(tmp_path, request, "flooding user")
    with AgentThread(config) as running, flooding(path, group.gr_gid):
        server = _sdk(running)
        # the flood is on: every connection in, the user's flows at its cap, refusals going
        refused_from = 2 * sdk_server.MAX_FLOWS_PER_UID
        wait_until(
            lambda: server.clients >= FLOOD_CONNECTIONS and server.requests["open"] > refused_from,
            timeout=30,
        )
        before = server.requests["open"]
        for _ in range(3):
            handle = _open_on_a_fresh_connection(path)
            assert handle.connected, f"root's open went unanswered for {client.OPEN_TIMEOUT} s"
            handle.close()
        assert server.requests["open"] > before  # the flood was served meanwhile


def test_job_reports_of_one_loop_turn_cost_the_local_policy_one_pass(tmp_path: Path) -> None:
    """With the local policy running (no coordinator configured, or none reachable), each
    ``job_progress`` a client sent re-evaluated every flow of the node at once: a user's share
    of one loop turn (64 reports) cost 64 passes, 1.1 s of the loop over 4,096 rmlq flows,
    while every other user's client waited. The reports of one turn now share one pass."""
    agent = Agent(agent_config(tmp_path, metrics_port=None))
    agent._attach_table()
    assert agent.registry is not None
    passes: list[int] = []
    try:
        for _ in range(10):
            agent.registry.open_sdk(1, FlowClass.BULK, 0.0)

        async def one_turn_of_reports() -> None:
            agent._enter_fallback(None)
            reevaluate = agent._reevaluate

            def counted() -> None:
                passes.append(len(agent._admitted))
                reevaluate()

            agent._reevaluate = counted  # type: ignore[method-assign]
            for step in range(MESSAGES_PER_TURN):
                agent.job_progress("j", step, None, owner=UID)
            for _ in range(3):  # the loop's next turns
                await asyncio.sleep(0)

        asyncio.run(one_turn_of_reports())
        assert passes == [10]
        assert agent.registry.job_index[f"{UID}/j"] == MESSAGES_PER_TURN - 1
    finally:
        assert agent.table is not None
        agent.table.detach()
        agent.table.close()


def test_the_agent_raises_its_open_file_limit(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip("the hard open-file limit leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        running = AgentThread(agent_config(tmp_path, metrics_port=None))
        running.start()
        try:
            raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            assert raised > 512 and raised in (hard, fdlimit.FD_CEILING)
            assert _sdk(running).max_connections > 512 - sdk_server.FD_RESERVE
        finally:
            running.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_request_names_are_scoped_to_the_uid(agent: AgentThread) -> None:
    sock = _raw(agent)
    opened = _ask(sock, sdk.Open(1, "kv", deadline=9e9, request="r1", job="j"))
    assert isinstance(opened, sdk.Opened)
    flow = agent.agent.registry.flows[opened.id]  # type: ignore[union-attr]
    assert (flow.request, flow.job) == (f"{UID}/r1", f"{UID}/j")


class _StuckLink:
    """A coordinator link whose peer stopped reading: the first frame leaves, the next
    waits in drain() for good."""

    def __init__(self, welcome: Welcome) -> None:
        self.welcome = welcome
        self.version = PROTOCOL_VERSION
        self.sent = 0

    async def send(self, message: object) -> None:
        self.sent += 1
        if self.sent > 1:
            await asyncio.Event().wait()


def test_a_resync_the_coordinator_does_not_read_ends_the_session(tmp_path: Path) -> None:
    config = agent_config(tmp_path, metrics_port=None)
    agent = Agent(config)
    agent._attach_table()
    assert agent.registry is not None
    for _ in range(3):
        agent.registry.open_sdk(1, FlowClass.BULK, 0.0)
    agent.job_progress("j", 1, None, owner=UID)
    link = _StuckLink(Welcome(agent.view.text or "", 0.001, 0.0, 0.01))
    index = agent._leader_index

    async def session() -> None:
        async with asyncio.timeout(5):  # the old code waited here for ever
            await agent._session(link)  # type: ignore[arg-type]

    try:
        with pytest.raises(TimeoutError, match="took no resync frame"):
            asyncio.run(session())
        assert link.sent == 2 and not agent.connected
        assert agent._leader_index == index + 1  # the next attempt tries the next address
    finally:
        assert agent.table is not None
        agent.table.detach()
        agent.table.close()


def test_what_a_client_passes_as_its_namespace_is_checked(tmp_path: Path) -> None:
    """A client shows its pid namespace with a descriptor; anything else it passes (a file, a
    network namespace) shows none (the closer thread closes them all: the next test)."""
    own = os.open("/proc/self/ns/pid", os.O_RDONLY)
    inode = os.fstat(own).st_ino
    other = [os.open(tmp_path, os.O_RDONLY), os.open("/proc/self/ns/net", os.O_RDONLY)]
    try:
        assert sdk_server._shown_namespace([own]) == inode
        assert sdk_server._shown_namespace([*other, own]) == inode
        assert sdk_server._shown_namespace(other) == 0
        assert sdk_server._shown_namespace([]) == 0
    finally:
        for fd in (own, *other):
            os.close(fd)


LINGER = 3  # seconds a close of the passed socket blocks the thread that makes it


@pytest.mark.parametrize(
    "when",
    [
        "first frame",  # the pid namespace's place: read by the agent's own first read
        "later frame",  # ends the connection (bad frame)
        "unread at a refusal",  # waiting in the queue of a connection the agent refuses
    ],
)
def test_a_lingering_socket_a_client_passes_does_not_hold_up_the_agent(
    agent: AgentThread, when: str
) -> None:
    """Whoever drops the last reference to such a socket blocks for its linger time: never the
    agent's loop (its only thread), or every other client's calls, the table's heartbeat and
    the coordinator link would wait that long (docs/security.md)."""
    server = _sdk(agent)
    held = threading.Event()
    if when == "unread at a refusal":
        agent.run(lambda: setattr(server, "max_connections_per_uid", 0))
        # the loop waits until the frame is sent: the connection is refused with it unread
        agent._loop.call_soon_threadsafe(held.wait, 10)
    passing = _raw(agent)
    if when == "later frame":
        assert isinstance(_ask(passing, sdk.Open(1, "bulk")), sdk.Opened)
    if when != "unread at a refusal":
        # the loop reads the frame only once the test's copy is closed: an agent that read it
        # and closed its copy first would leave the last reference, and the linger, to the test
        agent._loop.call_soon_threadsafe(held.wait, 10)
    lingering, peer = lingering_tcp_socket(LINGER)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [lingering.fileno()]))]
    started = time.monotonic()
    passing.sendmsg([sdk.encode(sdk.ListFlows())], rights)
    lingering.close()  # the agent holds the last reference now
    held.set()
    # another client, seen after the passing one (the loop takes ready sockets in turn), is
    # answered: its flow opened (or, where every connection is refused, the refusal)
    other = _raw(agent)
    answer = _ask(other, sdk.Open(2, "bulk"))
    assert type(answer) is (sdk.Error if when == "unread at a refusal" else sdk.Opened)
    assert time.monotonic() - started < LINGER / 3
    # answered while the close (in the closer's thread) was still held up
    assert server.closer.waiting > 0
    wait_until(lambda: server.closer.waiting == 0, timeout=LINGER + 5)
    peer.close()


#: seconds root's passed socket would hold up its close in the next test: far longer than the
#: test waits for nobody's descriptor (the test ends the close early by closing the peer)
LONG_LINGER = 60


def _hand_over_lingering(
    agent: AgentThread, passing: socket.socket, lingering: socket.socket
) -> None:
    """Pass ``lingering`` to ``agent`` over ``passing`` with a first frame (a listing) and close
    the test's copy, so that the agent's close of it is held up (its owner's closer thread
    waits there); return once the listing is answered and the close is under way."""
    held = threading.Event()  # the agent reads the frame once the test's copy is shut
    agent._loop.call_soon_threadsafe(held.wait, 10)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [lingering.fileno()]))]
    passing.sendmsg([sdk.encode(sdk.ListFlows())], rights)
    lingering.close()  # the agent holds the last reference now
    held.set()
    assert isinstance(_next(passing), sdk.FlowList)  # read: its close is under way
    assert _sdk(agent).closer.waiting_of(UID) == 1


#: connections in the next test: more than the closer's total (MAX_UNCLOSED)
EMPTY_CONNECTIONS = 600


def test_connections_that_leave_nothing_behind_do_not_wait_behind_a_held_up_close(
    agent: AgentThread,
) -> None:
    """Every ended connection's socket went to its user's closer thread: behind one socket the
    user passed whose close lingers, a flood of connections that connect and close (sending
    nothing) queued there and filled the agent's total, MAX_UNCLOSED, so that the agent took
    nobody's connections any more. A socket whose queue is empty once shut down both ways can
    hold no descriptor (on a stream socket one comes with a byte): it is closed at once."""
    server = _sdk(agent)
    lingering, peer = lingering_tcp_socket(LONG_LINGER)
    try:
        with _raw(agent) as passing:
            _hand_over_lingering(agent, passing, lingering)
            for _ in range(EMPTY_CONNECTIONS):  # some are refused (256 per user at once): alike
                with _raw(agent):
                    pass
            wait_until(lambda: len(server._connections) == 1, timeout=30)  # only `passing`
            assert server.closer.waiting_of(UID) == 1, "ended connections waited behind it"
            assert isinstance(_ask(passing, sdk.Open(1, "bulk")), sdk.Opened)
            with _raw(agent) as later:  # a new connection of the same user is served
                assert isinstance(_ask(later, sdk.Open(2, "bulk")), sdk.Opened)
    finally:
        peer.close()  # the held-up close returns at once
    wait_until(lambda: server.closer.waiting == 0)


@pytest.mark.skipif(UID != 0, reason="the other user's client runs as nobody: needs root")
def test_one_users_lingering_close_does_not_hold_up_closing_another_users_descriptors(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A single closer thread closed every user's descriptors in turn: while a socket root
    passed lingered, a descriptor nobody passed waited behind it, counted against nobody and
    the agent's total. Each owner's descriptors are closed in a thread of its own."""
    config, path, group = _config_nobody_reaches(tmp_path, request, "other user")
    # nobody passes the pipe's write end: the read end sees the end once the agent closed it
    closed, passed = os.pipe()
    go, told = os.pipe()
    with AgentThread(config) as running:
        server = _sdk(running)
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            _pass_when_told(path, group.gr_gid, passed, go, told)
        os.close(passed)
        os.close(go)
        exit_code: int | None = None
        # made after the fork: the child holds no copy of the lingering socket
        lingering, peer = lingering_tcp_socket(LONG_LINGER)
        try:
            with _raw(running) as passing:
                _hand_over_lingering(running, passing, lingering)
                os.write(told, b"x")
                shut, _, _ = select.select([closed], [], [], 10)
                assert shut, "nobody's descriptor waited behind root's lingering close"
                assert os.read(closed, 1) == b""
                assert server.closer.waiting_of(UID) == 1  # root's close is held up still
                exit_code = child_exit_code(child)
                assert exit_code == 0, "nobody's listing was not answered"
        finally:
            peer.close()  # root's close returns at once
            for fd in (closed, told):
                os.close(fd)  # a child not told yet reads the end and exits
            if exit_code is None:
                child_exit_code(child)
        wait_until(lambda: server.closer.waiting == 0)


def _pass_when_told(path: str, group: int, passed: int, go: int, told: int) -> None:
    """In a forked child of the root test process: as nobody, in ``group``, once the parent
    writes to ``told`` (read from ``go``: the child closes its copy of ``told``), pass
    descriptor ``passed`` to the agent at ``path`` with a first frame (a listing), close it,
    and wait for the answer; exit 0 once answered."""
    code = 1
    try:
        os.close(told)
        os.setgroups([group])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        if os.read(go, 1):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(path)
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [passed]))]
                sock.sendmsg([sdk.encode(sdk.ListFlows())], rights)
                os.close(passed)
                code = 0 if isinstance(_next(sock), sdk.FlowList) else 1
    finally:
        os._exit(code)


def test_flow_listings_of_a_user_are_rate_limited_but_not_roots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = sdk_server.SdkServer(None)  # type: ignore[arg-type]
    clock = [1000.0]
    monkeypatch.setattr(sdk_server.time, "monotonic", lambda: clock[0])
    burst = int(sdk_server.LIST_BURST)
    assert all(server._may_list(4242) for _ in range(burst))
    assert not server._may_list(4242)  # the burst is spent
    assert server._may_list(4343)  # another user's budget is its own
    assert all(server._may_list(0) for _ in range(3 * burst))  # root is not limited
    clock[0] += 10 / sdk_server.LIST_PAGES_PER_SECOND  # ten pages' worth of time
    assert sum(server._may_list(4242) for _ in range(20)) == 10


def test_a_users_list_budget_refills_up_to_the_burst_only(monkeypatch: pytest.MonkeyPatch) -> None:
    server = sdk_server.SdkServer(None)  # type: ignore[arg-type]
    clock = [1000.0]
    monkeypatch.setattr(sdk_server.time, "monotonic", lambda: clock[0])
    assert server._may_list(4242)
    clock[0] += 3600.0  # an hour idle earns no more than one burst
    burst = int(sdk_server.LIST_BURST)
    assert sum(server._may_list(4242) for _ in range(2 * burst)) == burst


def test_list_budgets_of_users_gone_quiet_are_not_kept_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A budget outlives the user's connections, but not once it is full again: every uid that
    ever listed (pods with their own uids, say) would otherwise keep one."""
    monkeypatch.setattr(sdk_server, "LIST_BUDGETS_KEPT", 64)
    server = sdk_server.SdkServer(None)  # type: ignore[arg-type]
    clock = [1000.0]
    monkeypatch.setattr(sdk_server.time, "monotonic", lambda: clock[0])
    burst = int(sdk_server.LIST_BURST)
    assert all(server._may_list(5000) for _ in range(burst))  # spent
    for uid in range(6000, 6000 + 200):
        assert server._may_list(uid)
        clock[0] += 0.001
    assert len(server._list_budget) <= 64 + 1
    clock[0] += 10.0  # every budget but a spent one is full again by now
    assert server._may_list(7000) and len(server._list_budget) <= 64 + 1
    assert not all(server._may_list(5000) for _ in range(burst + 1))  # not reset by a prune


def _listing_server(job: str, flows: int) -> sdk_server.SdkServer:
    """An SDK server over a real registry holding ``flows`` flows of root's, each of ``job``."""
    registry = FlowRegistry(node="n1", links=("n1:tx",), id_prefix=1)
    server = sdk_server.SdkServer(SimpleNamespace(registry=registry))  # type: ignore[arg-type]
    for ref in range(flows):
        asked = sdk.Open(ref, "kv", size=1 << 40, deadline=2e9, job=job, request=job)
        flow, _ = registry.open_sdk(7, FlowClass.KV, 1.7e9, size=asked.size,
                                    deadline=asked.deadline, job=job, request=job)  # fmt: skip
        server._opened[flow.flow_id] = (7, 0, asked)
        server._opened_of.setdefault(0, {})[flow.flow_id] = None
    return server


def test_a_page_of_flows_fits_its_frame_whatever_their_size() -> None:
    # a flow size whose whole number of flows fills a frame to within its own fields' bytes:
    # a page built up to the frame limit, without room for them, would not fit
    probe = _listing_server("j", 1)
    base = sdk.encoded_size(probe._flow_info(next(iter(probe._opened))))  # type: ignore[arg-type]
    size, job = next(
        (base - 2 + 2 * n, "j" * n)  # (the job and the request both take the name)
        for n in range(1, 200)
        if sdk.MAX_SDK_FRAME % (base - 2 + 2 * n) < 40
    )
    server = _listing_server(job, 2 * (sdk.MAX_SDK_FRAME // size) + 3)
    assert sdk.encoded_size(server._flow_info(next(iter(server._opened)))) == size  # type: ignore[arg-type]
    listed, after, pages = [], None, 0
    while True:
        page = server.flow_page(0, after)
        assert len(sdk.encode(page)) <= sdk.MAX_SDK_FRAME  # encode raises past the limit
        listed += [info.id for info in page.flows]
        pages += 1
        if not page.more:
            break
        after = page.flows[-1].id
    assert listed == list(server._opened) and pages > 1
