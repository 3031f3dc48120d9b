"""The agent service in-process (no coordinator: its local policy runs), on a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import agent_config, wait_until
from pid_namespace import unshared

from flowsched import client, qos
from flowsched.agent import AgentConfig, sdk_server, serve
from flowsched.agent.flows import MAX_JOBS
from flowsched.agent.threaded import AgentThread
from flowsched.model import FlowClass
from flowsched.protocol import sdk, write_token
from flowsched.shm import layout, pidns
from flowsched.shm.table import EmulatedPluginSlot, FlowTable


@pytest.fixture
def agent(tmp_path: Path, fresh_sdk_connections: None) -> Iterator[AgentThread]:
    with AgentThread(agent_config(tmp_path)) as running:
        yield running


def test_socket_and_table_are_private(agent: AgentThread) -> None:
    info = agent.ready
    assert info is not None
    assert stat.S_IMODE(os.stat(info.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(info.socket)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(info.table).st_mode) == 0o600


def test_local_policy_levels_reach_plugin_slots(agent: AgentThread) -> None:
    assert agent.ready is not None
    table = FlowTable.open(agent.ready.table, writable=True)
    try:
        wait_until(lambda: agent.agent.fallback is not None)  # no coordinator configured
        assert not table.flags() & layout.FLAG_COORDINATOR_CONNECTED
        conn = EmulatedPluginSlot(table, class_id=int(FlowClass.TP))
        conn.send(1000)
        wait_until(lambda: conn.raw_level() != layout.LEVEL_UNSET)
        registry = agent.agent.registry
        assert registry is not None
        flow_id = registry.slots[conn.index, conn.claim_seq].flow_id
        assert flow_id is not None
        assert conn.raw_level() == registry.flows[flow_id].level
        assert table.read_config().num_levels == agent.agent.view.num_levels
    finally:
        table.close()


def test_an_agent_without_a_coordinator_runs_its_policy_from_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing to wait for: no fallback_after delay, no "coordinator silent" warning, and no
    switch counted (the switch metric and its alert are about a lost coordinator)."""
    config = agent_config(tmp_path, fallback_after=60.0)
    with caplog.at_level(logging.INFO, logger="flowsched.agent"), AgentThread(config) as running:
        wait_until(lambda: running.agent.fallback is not None)
        assert running.agent.stats["fallback_switches"] == 0
    messages = [r.getMessage() for r in caplog.records if r.name == "flowsched.agent"]
    assert "no coordinator configured: running rmlq locally" in messages
    assert not [m for m in messages if "silent" in m]


def test_deadline_flow_is_promoted_by_the_local_policy(agent: AgentThread) -> None:
    assert agent.ready is not None
    wait_until(lambda: agent.agent.fallback is not None)
    levels: list[int] = []
    # MLU = 2e9 B / (1.5 s x 25e9 B/s) = 0.053 at first: a deferred band, promoted as t shrinks
    with client.flow(
        "kv", bytes=2_000_000_000, deadline=time.time() + 1.5, socket_path=agent.ready.socket
    ) as handle:
        end = time.monotonic() + 1.4
        while time.monotonic() < end:
            levels.append(handle.level)
            time.sleep(0.05)
    assert levels[-1] < max(levels), levels  # promoted while the deadline approached
    decided = levels[levels.index(max(levels)) :]
    assert decided == sorted(decided, reverse=True), levels  # never demoted after admission


def test_metrics_endpoint_reports_flows(agent: AgentThread) -> None:
    assert agent.ready is not None and agent.ready.metrics is not None
    with client.flow("experience", consumer_step=3, socket_path=agent.ready.socket):
        host, port = agent.ready.metrics
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    assert 'flowsched_agent_active_flows{class="experience"' in body
    assert 'source="sdk"' in body and "flowsched_agent_fallback_active 1.0" in body
    assert "flowsched_agent_coordinators_configured 0.0" in body  # standalone: not an outage


def test_the_sdk_flows_of_a_client_that_exited_are_closed_with_its_connection(
    agent: AgentThread,
) -> None:
    """A connection can outlive its process (handed to a child): its flows, open in the name
    of a pid that a later process may be given, close once the reaper sees it exited."""
    registry = agent.agent.registry
    assert registry is not None
    ready, release = os.pipe()
    opener = os.fork()
    if opener == 0:  # connect and open, leave the socket to a child that lives on, exit
        code = 1
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(agent.ready.socket)  # type: ignore[union-attr]
            sock.sendall(sdk.encode(sdk.Open(1, "bulk")))
            decoder = sdk.SdkDecoder("client")
            while decoder.next_message() is None:
                decoder.feed(sock.recv(65536))
            if os.fork() == 0:
                os.close(release)
                os.read(ready, 1)  # holds the socket until the test ends
                os._exit(0)
            code = 0
        finally:
            os._exit(code)
    try:
        assert os.waitpid(opener, 0)[1] == 0
        assert [info.pid for info in registry.sdk.values()] == [opener]
        wait_until(lambda: not registry.sdk, timeout=5)  # the reaper runs once a second
        assert _sdk_clients(agent) == 0
    finally:
        os.close(ready)
        os.close(release)  # the holder reads end-of-file and exits


def _sdk_clients(agent: AgentThread) -> int:
    assert agent.agent.sdk is not None
    return agent.agent.sdk.clients


def test_a_bad_sdk_client_does_not_harm_others(agent: AgentThread) -> None:
    assert agent.ready is not None
    with client.flow("bulk", socket_path=agent.ready.socket) as good:
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.connect(agent.ready.socket)
        bad.sendall(b"\x00\x00\x00\x05garbage")
        bad.settimeout(3)
        reply = bad.recv(4096)
        assert b"bad_frame" in reply
        assert bad.recv(4096) == b""  # closed by the agent
        bad.close()
        assert good.connected
        registry = agent.agent.registry
        assert registry is not None and good.id in registry.flows
        good.progress(5)
        wait_until(lambda: registry.flows[good.id].sent == 5)  # type: ignore[index]


def test_disconnecting_client_closes_its_flows(agent: AgentThread) -> None:
    assert agent.ready is not None
    handle = client.open_flow("kv", socket_path=agent.ready.socket)
    registry = agent.agent.registry
    assert registry is not None and handle.id in registry.flows
    client.connection(agent.ready.socket).close()
    wait_until(lambda: handle.id not in registry.flows)


def test_stopping_ends_the_sdk_connections_before_serve_returns(
    tmp_path: Path, fresh_sdk_connections: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A client with an open flow is still connected when the agent stops: its handler must
    end inside ``serve``. Left to ``asyncio.run``'s final cancel, Python 3.11's stream server
    logged "Exception in callback ... CancelledError" at every clean shutdown."""
    config = agent_config(tmp_path, metrics_port=None)
    handlers: list[set[asyncio.Task[None]]] = []

    async def main() -> None:
        async def trigger() -> None:
            handle = await asyncio.to_thread(client.open_flow, "kv", socket_path=config.socket_path)
            assert handle.connected
            tasks = asyncio.all_tasks()
            handlers.append({t for t in tasks if t.get_coro().__qualname__ == "SdkServer._serve"})
            assert handlers[0], "the SDK connection's handler task was not found"

        await serve(config, shutdown_trigger=trigger)
        assert [t for t in handlers[0] if not t.done()] == []

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_a_client_that_has_sent_nothing_yet_ends_with_the_agent(
    tmp_path: Path,
    fresh_sdk_connections: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent reads a client's first bytes itself (they may carry the client's namespace
    descriptor); a client that connected and said nothing is let go at shutdown, not left to
    the idle timeout or to close()'s cancel of late handlers."""
    monkeypatch.setattr(sdk_server, "CLOSE_TIMEOUT", 600.0)  # a handler left to it hangs
    config = agent_config(tmp_path, metrics_port=None)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    handlers: list[asyncio.Task[None]] = []

    async def main() -> None:
        async def trigger() -> None:
            await asyncio.to_thread(silent.connect, config.socket_path)
            wait = asyncio.get_running_loop().time() + 10
            while not handlers and asyncio.get_running_loop().time() < wait:
                tasks = asyncio.all_tasks()
                handlers.extend(t for t in tasks if t.get_coro().__qualname__ == "SdkServer._serve")
                await asyncio.sleep(0)
            assert handlers, "the silent client's handler task was not found"

        async with asyncio.timeout(60):
            await serve(config, shutdown_trigger=trigger)
        assert all(t.done() and not t.cancelled() for t in handlers)

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run(main())
        silent.settimeout(5)
        assert silent.recv(1) == b""  # closed by the agent
    finally:
        silent.close()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


_JOB_IN_ITS_OWN_PID_NAMESPACE = """
import os, sys, time
from flowsched import client
from flowsched.shm.table import EmulatedPluginSlot, FlowTable
handle = client.open_flow("kv", bytes=1 << 30, deadline=time.time() + 60, socket_path=sys.argv[2])
conn = EmulatedPluginSlot(FlowTable.open(sys.argv[1], writable=True), class_id=int(sys.argv[3]))
conn.send(4096)
print(os.getpid(), handle.id, conn.index, conn.claim_seq, flush=True)
sys.stdin.readline()
"""


def test_a_job_in_a_pid_namespace_of_its_own_gets_its_connections_linked_and_reaped(
    agent: AgentThread,
) -> None:
    """A pod without hostPID: its plugin writes pids of its own namespace, its SDK flows come
    with host pids (SO_PEERCRED). The agent places the slot's owner through /proc, so the
    connection is carried by the SDK flow of its process, and freed once that process exits."""
    assert agent.ready is not None
    registry = agent.agent.registry
    assert registry is not None
    script = _JOB_IN_ITS_OWN_PID_NAMESPACE
    args = (agent.ready.table, agent.ready.socket, str(int(FlowClass.KV)))
    job = unshared(sys.executable, "-c", script, *args)
    try:
        assert job.stdout is not None and job.stdin is not None
        inner, flow_id, index, seq = map(int, job.stdout.readline().split())
        wait_until(lambda: registry.flows.get(flow_id) is not None)
        wait_until(lambda: (index, seq) in registry.slots)
        conn = registry.slots[index, seq]
        snap = agent.agent.table.slot(index)  # type: ignore[union-attr]
        assert snap is not None and conn.pid == snap.pid_ns << 32 | inner != inner
        assert conn.flow_id is None  # carried by the SDK flow, not a flow of its own
        wait_until(lambda: registry.flows[flow_id].sent == 4096)
        job.stdin.write("\n")
        job.stdin.flush()
        assert job.wait(timeout=10) == 0
        table = FlowTable.open(agent.ready.table)
        try:
            wait_until(lambda: table.slot_state(index) == layout.SLOT_FREE)  # reaped
        finally:
            table.close()
    finally:
        job.kill()
        job.wait()


def test_a_slot_whose_owner_the_agent_cannot_place_is_kept_counted_and_reported(
    agent: AgentThread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A job under another uid, the agent without CAP_SYS_PTRACE: the job's namespace links
    cannot be read. Its slot is neither reaped (its owner may live) nor linked, and says so."""
    assert agent.ready is not None and agent.ready.metrics is not None
    job = unshared(sys.executable, "-c", "import sys; print(1, flush=True); sys.stdin.readline()")
    readlink = os.readlink

    def denied(path: str) -> str:  # every other process's namespace link, as for another uid
        if path.startswith("/proc/") and path.endswith("/ns/pid") and "/self/" not in path:
            raise PermissionError(13, "Permission denied", path)
        return readlink(path)

    try:
        assert job.stdout is not None and job.stdout.readline() == "1\n"  # pid 1 in there
        monkeypatch.setattr(pidns.os, "readlink", denied)
        table = FlowTable.open(agent.ready.table, writable=True)
        try:
            foreign = agent.agent.table.pid_namespaces.own + 1  # type: ignore[union-attr]
            conn = EmulatedPluginSlot(table, class_id=int(FlowClass.KV), pid=1, pid_ns=foreign)
            host, port = agent.ready.metrics
            url = f"http://{host}:{port}/metrics"

            def unplaced() -> bool:
                body = urllib.request.urlopen(url, timeout=5).read().decode()
                return "flowsched_agent_table_slots_unplaced 1.0" in body

            with caplog.at_level(logging.WARNING, logger="flowsched.agent"):
                wait_until(unplaced, timeout=10)
            assert table.slot_state(conn.index) == layout.SLOT_ACTIVE  # not reaped
            assert any("does not let the agent place" in r.getMessage() for r in caplog.records)
        finally:
            table.close()
    finally:
        job.kill()
        job.wait()


def test_restart_reattaches_and_keeps_levels(tmp_path: Path) -> None:
    first = AgentThread(agent_config(tmp_path))
    info = first.start()
    table = FlowTable.open(info.table, writable=True)
    try:
        conn = EmulatedPluginSlot(table, class_id=int(FlowClass.PARAM_SYNC))
        wait_until(lambda: conn.raw_level() != layout.LEVEL_UNSET)
        level = conn.raw_level()
        first.stop()
        assert table.header()["agent_pid"] == 0
        second = AgentThread(agent_config(tmp_path))
        info2 = second.start()
        try:
            assert info2.generation == info.generation + 1
            assert conn.raw_level() == level  # untouched across the restart
            registry = second.agent.registry
            assert registry is not None
            wait_until(lambda: (conn.index, conn.claim_seq) in registry.slots)
            conn.send(10)
            flow_id = registry.slots[conn.index, conn.claim_seq].flow_id
            wait_until(lambda: registry.flows[flow_id].sent == 10)  # type: ignore[index]
        finally:
            second.stop()
    finally:
        table.close()


def test_second_agent_on_the_same_socket_is_refused(agent: AgentThread, tmp_path: Path) -> None:
    from flowsched.agent.sdk_server import SocketPathError

    assert agent.ready is not None
    other = AgentThread(agent_config(tmp_path, table_path=str(tmp_path / "t2")))
    with pytest.raises(SocketPathError, match="already serving"):
        other.start()
    other.stop()
    assert os.path.exists(agent.ready.socket)  # the refused agent left the first one's socket
    with client.flow("kv", socket_path=agent.ready.socket) as handle:
        assert handle.connected


@pytest.mark.parametrize("cause", ["metrics port in use", "socket served by another agent"])
def test_an_agent_thread_that_fails_to_start_leaves_nothing_running(
    tmp_path: Path, cause: str
) -> None:
    """``AgentThread.start`` raised and left the half-started agent on its thread: with the
    metrics port in use (the last step) its SDK socket went on accepting clients, so that the
    next agent at that path was refused as a second one, and the table named it as its live
    owner. ``with AgentThread(...)`` never reached ``stop`` to undo it."""
    with contextlib.ExitStack() as stack:
        if cause == "metrics port in use":
            port = stack.enter_context(socket.create_server(("127.0.0.1", 0))).getsockname()[1]
            config = agent_config(tmp_path, metrics_port=port)
        else:
            first = stack.enter_context(AgentThread(agent_config(tmp_path / "first")))
            assert first.ready is not None
            config = agent_config(tmp_path, socket_path=first.ready.socket)
        failed = AgentThread(config)
        with pytest.raises(OSError if cause == "metrics port in use" else RuntimeError):
            failed.start()
        assert not failed._thread.is_alive()
        with FlowTable.open(config.table_path) as table:
            assert table.header()["agent_pid"] == 0  # detached: no live owner
        if cause == "metrics port in use":
            with socket.socket(socket.AF_UNIX) as probe, pytest.raises(OSError):
                probe.connect(config.socket_path)  # nobody serves it, nor is it left behind
        else:  # the first agent's socket is still its own
            with client.flow("kv", socket_path=config.socket_path) as handle:
                assert handle.connected
            client._connections.pop(config.socket_path).close()


def test_metrics_count_completions_and_local_decisions(agent: AgentThread) -> None:
    assert agent.ready is not None and agent.ready.metrics is not None
    wait_until(lambda: agent.agent.fallback is not None)
    with client.flow("kv", bytes=10, deadline=time.time() + 60, socket_path=agent.ready.socket):
        pass
    with client.flow("kv", bytes=10, deadline=time.time() - 1, socket_path=agent.ready.socket):
        pass
    wait_until(lambda: sum(agent.agent.telemetry.completions.values()) == 2)
    host, port = agent.ready.metrics
    body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    assert 'flowsched_agent_completed_flows_total{class="kv",deadline="met"} 1.0' in body
    assert 'flowsched_agent_completed_flows_total{class="kv",deadline="missed"} 1.0' in body
    # lateness and earliness: separate histograms of non-negative values
    assert "flowsched_agent_deadline_lateness_seconds_count 1.0" in body
    assert "flowsched_agent_deadline_earliness_seconds_count 1.0" in body
    assert "flowsched_agent_local_decision_latency_seconds_bucket" in body
    assert 'flowsched_agent_sdk_requests_total{type="open"} 2.0' in body
    assert 'node="' not in body  # the scrape target names the node


@pytest.mark.parametrize(
    ("env", "nic_interval", "capacity"),
    [
        pytest.param({}, 1.0, None, id="defaults"),
        pytest.param(
            {"FLOWSCHED_NIC_INTERVAL": "0.02", "FLOWSCHED_LINK_CAPACITY": "25e6"},
            0.02,
            25e6,
            id="from-environment",
        ),
        pytest.param(
            {"FLOWSCHED_NIC_INTERVAL": "x", "FLOWSCHED_LINK_CAPACITY": "-1"},
            1.0,
            None,
            id="invalid-ignored",
        ),
    ],
)
def test_nic_settings_from_environment(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    nic_interval: float,
    capacity: float | None,
) -> None:
    monkeypatch.delenv("FLOWSCHED_NIC_INTERVAL", raising=False)
    monkeypatch.delenv("FLOWSCHED_LINK_CAPACITY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = AgentConfig(node="n", socket_path="/nonexistent/s")
    assert (config.nic_interval, config.link_capacity) == (nic_interval, capacity)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        pytest.param({"node": "n\t1"}, "node", id="node-not-printable"),
        pytest.param({"node": "n1 "}, "node", id="node-trailing-blank"),
        pytest.param({"node": "n" * 129}, "node", id="node-too-long"),
        pytest.param({"link_capacity": float("inf")}, "link_capacity", id="inf-capacity"),
        pytest.param({"link_capacity": 0.0}, "link_capacity", id="zero-capacity"),
        pytest.param({"default_bandwidth": 0.0}, "default_bandwidth", id="zero-bandwidth"),
        pytest.param({"fallback_after": float("nan")}, "fallback_after", id="nan-fallback"),
        pytest.param({"nic_interval": -1.0}, "nic_interval", id="negative-nic-interval"),
        pytest.param({"poll_interval": float("inf")}, "poll_interval", id="inf-poll"),
        pytest.param({"reconnect_interval": 0}, "reconnect_interval", id="zero-reconnect"),
    ],
)
def test_config_refuses_values_that_would_fail_later(
    tmp_path: Path, overrides: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        agent_config(tmp_path, **overrides)


def test_environment_infinity_is_not_a_nic_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWSCHED_NIC_INTERVAL", "inf")
    monkeypatch.setenv("FLOWSCHED_LINK_CAPACITY", "inf")
    config = AgentConfig(node="n", socket_path="/nonexistent/s")
    assert (config.nic_interval, config.link_capacity) == (1.0, None)


def test_a_peer_narrowed_sdk_flow_takes_a_connection_once_the_plugin_learns_its_peer(
    agent: AgentThread,
) -> None:
    """The plugin claims a send slot with peer -1 and fills the peer in later: the agent
    re-reads it and links the connection to the SDK flow narrowed to that peer."""
    assert agent.ready is not None
    registry = agent.agent.registry
    assert registry is not None
    table = FlowTable.open(agent.ready.table, writable=True)
    try:
        conn = EmulatedPluginSlot(table, class_id=int(FlowClass.PARAM_SYNC))  # peer -1
        key = (conn.index, conn.claim_seq)
        wait_until(lambda: key in registry.slots)
        with client.flow(
            "param_sync", bytes=10**9, deadline=time.time() + 60, peer=7,
            socket_path=agent.ready.socket,
        ) as handle:  # fmt: skip
            assert registry.slots[key].linked_to is None  # its destination is not known yet
            conn.set_peer(7)  # the receiver's rank note arrived
            wait_until(lambda: registry.slots[key].linked_to == handle.id)
            conn.send(500)
            wait_until(lambda: registry.flows[handle.id].sent >= 500)

            def carries_the_flows_level() -> bool:
                level = registry.flows[handle.id].level
                return level >= 0 and conn.raw_level() == agent.agent.view.table_level(level)

            wait_until(carries_the_flows_level)
    finally:
        table.close()


def test_slots_other_than_an_existing_tables_size_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    FlowTable.create_or_attach(str(tmp_path / "table"), num_slots=8)[0].close()
    with (
        caplog.at_level(logging.WARNING, logger="flowsched.agent"),
        AgentThread(agent_config(tmp_path, num_slots=32)) as running,
    ):
        assert running.agent.table is not None and running.agent.table.num_slots == 8
    (warning,) = [r.getMessage() for r in caplog.records if "--slots" in r.getMessage()]
    assert "has 8 slots, not the 32 asked for" in warning
    assert "remove the file" in warning and "move their connections" in warning


def test_a_slot_with_no_possible_pid_is_reaped_and_logged(
    agent: AgentThread, caplog: pytest.LogCaptureFixture
) -> None:
    assert agent.ready is not None
    table = FlowTable.open(agent.ready.table, writable=True)
    try:
        with caplog.at_level(logging.WARNING, logger="flowsched.agent"):
            conn = EmulatedPluginSlot(table, pid=2**31)  # what any table writer can store
            wait_until(lambda: table.slot_state(conn.index) == layout.SLOT_FREE)
            wait_until(lambda: any("no process can have" in r.getMessage() for r in caplog.records))
        assert agent.agent.stats["slots_bad_pid"] >= 1
    finally:
        table.close()


@contextlib.contextmanager
def _agent_without_a_session(tmp_path: Path, coordinator: str) -> Iterator[AgentThread]:
    """A running agent that has no coordinator session: none configured (``"none"``), or
    one whose address takes connections and never answers the handshake (``"unreachable"``)."""
    with socket.socket() as silent:  # listens, never answers the handshake
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        overrides: dict[str, object] = {}
        if coordinator == "unreachable":
            write_token(tmp_path / "token")
            overrides = dict(
                coordinator=silent.getsockname(),
                token_file=str(tmp_path / "token"),
                connect_timeout=30.0,
            )
        with AgentThread(agent_config(tmp_path, **overrides)) as running:
            assert running.ready is not None
            yield running


@pytest.mark.parametrize("coordinator", ["none", "unreachable"])
def test_opens_and_closes_no_coordinator_will_read_are_not_kept(
    tmp_path: Path, fresh_sdk_connections: None, coordinator: str
) -> None:
    """Without a coordinator link nothing takes the opens and closes queued for it (the next
    connection's resync carries the whole flow set): an agent without a coordinator, or cut
    off from it, kept one of each for every flow that ever opened, without bound."""
    with _agent_without_a_session(tmp_path, coordinator) as running:
        assert running.ready is not None
        registry = running.agent.registry
        assert registry is not None
        wait_until(lambda: running.agent.fallback is not None)

        def tracked(key: tuple[int, int]) -> bool:
            return bool(running.run(lambda: key in registry.slots))

        table = FlowTable.open(running.ready.table, writable=True)
        try:
            for _ in range(20):
                conn = EmulatedPluginSlot(table, class_id=int(FlowClass.TP))
                wait_until(functools.partial(tracked, (conn.index, conn.claim_seq)))
                with client.flow("kv", bytes=100, socket_path=running.ready.socket) as h:
                    assert h.connected
                conn.close()
            wait_until(lambda: running.run(lambda: not registry.flows))
        finally:
            table.close()
        queued = running.run(lambda: len(registry._pending_opens) + len(registry._closes))
        assert queued == 0


@pytest.mark.parametrize("coordinator", ["none", "unreachable"])
def test_job_ends_no_coordinator_will_read_are_bounded(
    tmp_path: Path, fresh_sdk_connections: None, coordinator: str
) -> None:
    """A job's end is kept for the next coordinator session (it forgets the job then, not at
    its TTL); without a coordinator, or cut off from it, every end of a distinct job was kept
    for good. Without one none is kept; cut off, at most as many as the jobs a node keeps."""
    ends = 2 * MAX_JOBS + 100
    with _agent_without_a_session(tmp_path, coordinator) as running:
        assert running.ready is not None
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(running.ready.socket)
            frames = (sdk.encode(sdk.JobProgress(f"j{i}", 1, done=True)) for i in range(ends))
            sock.sendall(b"".join(frames))
            requests = running.agent.sdk.requests  # type: ignore[union-attr]
            wait_until(lambda: running.run(lambda: requests["job_progress"]) == ends)
        kept = running.run(lambda: len(running.agent._job_updates))
        assert kept <= (0 if coordinator == "none" else 2 * MAX_JOBS)


# -- --qos-dev ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "failure",
    [
        BlockingIOError(11, "Resource temporarily unavailable"),  # fork failed
        KeyError("kind"),  # a bug, or tc output this cannot read
        qos.QosError("tc qdisc: RTNETLINK answers: Operation not permitted"),
    ],
    ids=["os-error", "bug", "qos-error"],
)
def test_the_qos_repair_loop_goes_on_after_a_failed_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """docs/qos.md: errors are logged and the agent carries on checking the device."""
    calls: list[int] = []

    def apply(agent: object, cfg: object) -> list[str]:
        calls.append(len(calls))
        if len(calls) == 2:  # the first check after the start's (a failure there is fatal)
            raise failure
        return []

    monkeypatch.setattr("flowsched.agent.service.Agent._apply_qos", apply)
    config = agent_config(tmp_path, qos_dev="lo", qos_check_interval=0.05)
    with AgentThread(config):
        wait_until(lambda: len(calls) >= 4)


@pytest.mark.parametrize(
    "run,output",
    [
        (OSError(11, "Resource temporarily unavailable"), None),
        (None, "not json"),
        (None, '[{"root": true}]'),  # no "kind"
    ],
    ids=["cannot-run", "not-json", "no-kind"],
)
def test_what_tc_does_wrong_is_a_qos_error(
    monkeypatch: pytest.MonkeyPatch, run: OSError | None, output: str | None
) -> None:
    def fake_run(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        if run is not None:
            raise run
        return subprocess.CompletedProcess([], 0, output, "")

    monkeypatch.setattr(qos.subprocess, "run", fake_run)
    with pytest.raises(qos.QosError):
        qos.observe("lo")
