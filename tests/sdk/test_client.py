"""flowsched.client against a real agent on a background thread, and without any agent."""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flowsched import client, rundir
from flowsched.agent import AgentConfig
from flowsched.agent.threaded import AgentThread
from flowsched.model import FlowClass
from flowsched.protocol import sdk
from flowsched.shm.table import EmulatedPluginSlot, FlowTable


def _wait(predicate, timeout: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_flow_is_opened_reported_and_closed(agent: AgentThread) -> None:
    path = agent.ready.socket  # type: ignore[union-attr]
    deadline = time.time() + 30
    with client.flow("kv", bytes=1000, deadline=deadline, request="r1", socket_path=path) as handle:
        assert handle.connected and handle.id is not None
        flow = agent.agent.registry.flows[handle.id]  # type: ignore[union-attr]
        assert (flow.cls, flow.size, flow.deadline, flow.request) == (
            FlowClass.KV,
            1000,
            deadline,
            f"{os.geteuid()}/r1",  # scoped like job names: no other user can prune it
        )
        # the level the agent's own copy of the policy admits it at (rmlq: deferred), not the
        # class's static default
        admitted = agent.agent.view.cfg.make_policy().admit(flow, agent.agent._context())
        assert handle.level == admitted.level != agent.agent.view.default_level(FlowClass.KV)
        assert handle.dscp == agent.agent.view.marking(handle.level).dscp
        assert handle.tos == handle.dscp << 2
        handle.progress(400)
        _wait(lambda: flow.sent == 400)
    _wait(lambda: handle.id not in agent.agent.registry.flows)  # type: ignore[union-attr]


def test_level_changes_are_pushed_to_listeners(agent: AgentThread) -> None:
    seen: list[int] = []
    changed = threading.Event()
    with client.flow("param_sync", socket_path=agent.ready.socket) as handle:  # type: ignore[union-attr]
        handle.add_listener(lambda h: (seen.append(h.level), changed.set()))
        agent.run(lambda: agent.agent.apply_levels([(handle.id, 0)]))
        assert changed.wait(3)
        assert handle.level == 0 and seen == [0]
        assert handle.dscp == agent.agent.view.marking(0).dscp


def test_dst_node_adds_the_receivers_ingress_link(agent: AgentThread) -> None:
    path = agent.ready.socket  # type: ignore[union-attr]
    registry = agent.agent.registry
    assert registry is not None
    with (
        client.flow("kv", bytes=10, dst_node="h2", socket_path=path) as to_h2,
        client.flow("kv", bytes=10, socket_path=path) as unknown,
    ):
        assert registry.flows[to_h2.id].links == ("n1:tx", "h2:rx")  # type: ignore[index]
        assert registry.flows[unknown.id].links == ("n1:tx",)  # type: ignore[index]
    with pytest.raises(ValueError, match="dst_node"):
        client.open_flow("kv", dst_node="bad\nname", socket_path=path)


def test_decision_stamps_reach_the_handle(agent: AgentThread) -> None:
    changed = threading.Event()
    with client.flow("param_sync", socket_path=agent.ready.socket) as handle:  # type: ignore[union-attr]
        assert handle.decided_ns is None and handle.decided_at is None  # first level: local
        handle.add_listener(lambda h: changed.set())
        stamps = {handle.id: (1_700_000_000.25, 987_654_321)}
        agent.run(lambda: agent.agent.apply_levels([(handle.id, 0)], stamps))  # type: ignore[list-item, dict-item]
        assert changed.wait(3)
        assert (handle.level, handle.decided_at, handle.decided_ns) == (
            0,
            1_700_000_000.25,
            987_654_321,
        )


def test_linking_rule_moves_plugin_bytes_and_levels(agent: AgentThread) -> None:
    table = FlowTable.open(agent.ready.table, writable=True)  # type: ignore[union-attr]
    try:
        same = EmulatedPluginSlot(table, class_id=int(FlowClass.EXPERIENCE), peer_rank=1)
        other_peer = EmulatedPluginSlot(table, class_id=int(FlowClass.EXPERIENCE), peer_rank=2)
        registry = agent.agent.registry
        assert registry is not None
        _wait(lambda: len(registry.slots) == 2)
        with client.flow(
            "experience", consumer_step=5, job="j", peer=1, socket_path=agent.ready.socket
        ) as handle:  # type: ignore[union-attr]
            same.send(700)
            other_peer.send(50)
            _wait(lambda: registry.flows[handle.id].sent == 700)  # type: ignore[index]
            agent.run(lambda: agent.agent.apply_levels([(handle.id, 2)]))
            assert same.raw_level() == 2
            assert other_peer.raw_level() != 2
        _wait(lambda: registry.slots[same.index, same.claim_seq].flow_id is not None)
    finally:
        table.close()


def test_job_progress_reaches_the_agent(agent: AgentThread) -> None:
    assert client.job_progress("job-7", 12, layer=3, socket_path=agent.ready.socket)  # type: ignore[union-attr]
    scoped = f"{os.geteuid()}/job-7"  # the agent scopes job names to the client's uid
    _wait(lambda: agent.agent.registry.job_index.get(scoped) == 12)  # type: ignore[union-attr]


def test_a_jobs_end_makes_the_agent_forget_it(agent: AgentThread) -> None:
    path = agent.ready.socket  # type: ignore[union-attr]
    running = agent.agent
    scoped = f"{os.geteuid()}/batch-3"
    assert client.job_progress("batch-3", 7, layer=7, socket_path=path)
    _wait(lambda: running.registry.job_index.get(scoped) == 7)  # type: ignore[union-attr]
    assert client.job_progress("batch-3", 8, done=True, socket_path=path)
    _wait(lambda: scoped not in running.registry.job_index)  # type: ignore[union-attr]
    assert scoped not in {u.job for u in running.jobs.latest()}  # not re-sent at a resync


def test_without_agent_degrades_to_static_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "nobody.sock")
    caplog.set_level(logging.WARNING, logger="flowsched.client")
    try:
        with client.flow("tp", socket_path=path) as first:
            assert not first.connected
            assert first.marking == client.static_marking(FlowClass.TP)
            first.progress(10)  # must not raise
        with client.flow("bulk", socket_path=path) as second:
            assert second.level == client.static_marking(FlowClass.BULK).level
        assert not client.job_progress("j", 1, socket_path=path)
    finally:
        client._connections.pop(path, None)
    warnings = [r for r in caplog.records if "no flowsched agent" in r.getMessage()]
    assert len(warnings) == 1


def test_static_default_follows_the_embedded_policy() -> None:
    from flowsched import policyfile

    cfg = policyfile.embedded_default()
    mark = client.static_marking(FlowClass.KV)
    assert mark.level == cfg.classes[FlowClass.KV].default_level
    assert mark.dscp == cfg.levels[mark.level].dscp


@pytest.fixture
def policy_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the SDK's reads of the embedded policy file (its static defaults' cache is
    emptied before and after)."""
    from flowsched import policyfile

    reads: list[int] = []
    embedded = policyfile.embedded_default

    def counting() -> policyfile.PolicyConfig:
        reads.append(1)
        return embedded()

    monkeypatch.setattr(policyfile, "embedded_default", counting)
    client.static_marking.cache_clear()
    yield reads
    client.static_marking.cache_clear()


def test_static_default_reads_the_policy_file_once(tmp_path: Path, policy_reads: list[int]) -> None:
    # every flow starts at its class's static level: parsing the policy file per open cost
    # milliseconds of the application's time with the GIL held
    path = str(tmp_path / "nobody.sock")
    try:
        for _ in range(3):
            with client.flow("kv", socket_path=path) as handle:
                assert handle.marking == client.static_marking(FlowClass.KV)
    finally:
        client._connections.pop(path, None)
    assert len(policy_reads) == 1


def test_an_open_the_agent_answers_never_reads_the_policy_file(
    agent: AgentThread, policy_reads: list[int]
) -> None:
    """The static default stands in only until the agent answers: reading it on every first
    open of a class cost the application 10-50 ms in the first open of a process (the policy
    file's imports and parse) and about 1 ms for each further class."""
    seen: list[int] = []
    for cls in ("kv", "tp", "bulk"):
        with client.flow(cls, socket_path=agent.ready.socket) as handle:  # type: ignore[union-attr]
            assert handle.connected
            assert handle.marking.dscp == agent.agent.view.marking(handle.level).dscp
            handle.add_listener(lambda h: seen.append(h.level))
            target = 1 if handle.level == 0 else 0  # a change: the listener is called
            agent.run(functools.partial(agent.agent.apply_levels, [(handle.id, target)]))
            _wait(lambda target=target: seen[-1:] == [target])
    assert policy_reads == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"bytes": -1}, "bytes", id="negative-bytes"),
        pytest.param({"deadline": "soon"}, "deadline", id="text-deadline"),
        pytest.param({"peer": -3}, "peer", id="bad-peer"),
        pytest.param({"job": "a\nb"}, "job", id="job-not-printable"),
        pytest.param({"request": ""}, "request", id="empty-request"),
        pytest.param({"consumer_step": -1}, "consumer_step", id="negative-consumer-step"),
    ],
)
def test_argument_errors_raise(kwargs: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        client.open_flow("kv", socket_path=str(tmp_path / "x"), **kwargs)  # type: ignore[arg-type]


def test_default_socket_path_honours_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOWSCHED_SOCKET", "/tmp/somewhere.sock")
    assert client.default_socket_path() == "/tmp/somewhere.sock"
    monkeypatch.delenv("FLOWSCHED_SOCKET")
    expected = "/run/flowsched/agent.sock" if os.geteuid() == 0 else None
    if expected:
        assert client.default_socket_path() == expected


def _drop_connection(socket_path: str) -> None:
    """Close and forget the SDK's connection to ``socket_path`` (the next test makes its own)."""
    conn = client._connections.pop(socket_path, None)
    if conn is not None:
        conn.close()


def _restartable_agent(tmp_path: Path) -> AgentConfig:
    """An agent the tests stop and start again at the same socket and table."""
    return AgentConfig(
        node="n1",
        socket_path=str(tmp_path / "agent.sock"),
        table_path=str(tmp_path / "table"),
        num_slots=8,
        metrics_port=None,
        fallback_after=60.0,
        interfaces=("lo",),
    )


def _restart(first: AgentThread, config: AgentConfig, handle: client.FlowHandle) -> AgentThread:
    """Stop ``first``, wait until ``handle`` lost it, start a second agent at the same socket
    and wait until ``handle`` is re-opened there (the caller stops the second)."""
    first.stop()
    _wait(lambda: handle.id is None)
    second = AgentThread(config)
    second.start()
    _wait(lambda: handle.id is not None)
    return second


def test_open_flows_are_reopened_at_a_restarted_agent(tmp_path: Path) -> None:
    config = _restartable_agent(tmp_path)
    first = AgentThread(config)
    first.start()
    try:
        handle = client.open_flow("param_sync", bytes=100, socket_path=config.socket_path)
        handle.progress(40)
        old_id = handle.id
        assert old_id is not None
        second = _restart(first, config, handle)
        try:
            registry = second.agent.registry
            assert registry is not None
            _wait(lambda: handle.id in registry.flows and registry.flows[handle.id].sent == 40)
            assert registry.flows[handle.id].size == 100  # type: ignore[index]
            handle.close()
            _wait(lambda: not registry.flows)
        finally:
            second.stop()
    finally:
        client._connections.pop(config.socket_path, None)


def test_a_restarted_agent_learns_each_running_jobs_last_step(tmp_path: Path) -> None:
    """A trainer reports once per (long) step: a restarted agent knew no job's step until the
    next report. The connection sends the last step of every job not yet done again, before
    it re-opens the flows."""
    config = _restartable_agent(tmp_path)
    first = AgentThread(config)
    first.start()
    try:
        handle = client.open_flow("param_sync", bytes=100, socket_path=config.socket_path)
        path, uid = config.socket_path, os.geteuid()
        assert client.job_progress("train-1", 12, layer=3, socket_path=path)
        assert client.job_progress("serve-2", 4, socket_path=path)
        assert client.job_progress("serve-2", 5, done=True, socket_path=path)
        registry = first.agent.registry
        assert registry is not None
        _wait(
            lambda: (
                f"{uid}/serve-2" not in registry.job_index
                and f"{uid}/train-1" in registry.job_index
            )
        )
        second = _restart(first, config, handle)
        try:
            again = second.agent.registry
            assert again is not None
            _wait(lambda: again.job_index.get(f"{uid}/train-1") == 12)
            assert f"{uid}/serve-2" not in again.job_index  # done: not sent again
            handle.close()
        finally:
            second.stop()
    finally:
        client._connections.pop(config.socket_path, None)


def test_a_connection_remembers_only_the_latest_jobs() -> None:
    conn = client.AgentConnection("/nonexistent/agent.sock")
    for job in range(client.REMEMBERED_JOBS + 5):
        assert not conn.report_job(sdk.JobProgress(f"j{job}", 1))
    assert not conn.report_job(sdk.JobProgress("j7", 2))  # reported again: the latest
    assert len(conn._jobs) == client.REMEMBERED_JOBS
    kept = [f"j{job}" for job in range(5, client.REMEMBERED_JOBS + 5) if job != 7]
    assert list(conn._jobs) == [*kept, "j7"]
    assert conn._jobs["j7"].step == 2


def test_flow_opened_before_the_agent_starts_is_adopted(tmp_path: Path) -> None:
    config = AgentConfig(
        node="n1",
        socket_path=str(tmp_path / "agent.sock"),
        table_path=str(tmp_path / "table"),
        num_slots=8,
        metrics_port=None,
        fallback_after=60.0,
        interfaces=("lo",),
    )
    try:
        with client.flow("kv", socket_path=config.socket_path) as handle:
            assert not handle.connected
            with AgentThread(config):
                _wait(lambda: handle.connected)
    finally:
        _drop_connection(config.socket_path)


class _OsAsUser:
    """The ``os`` module as a process running as ``uid`` sees it (geteuid only)."""

    def __init__(self, uid: int) -> None:
        self._uid = uid

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def geteuid(self) -> int:
        return self._uid


@pytest.fixture
def user_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_sdk_connections: None) -> Path:
    """A node as a user's process sees it: its runtime directory is ``tmp_path/xdg``, the root
    agent's ``/run/flowsched`` the returned path (neither exists yet). The SDK's path finding
    runs as a user (uid 1000 under root, else this user), an agent of the test as root."""
    monkeypatch.setattr(rundir, "os", _OsAsUser(os.geteuid() or 1000))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    monkeypatch.delenv("FLOWSCHED_SOCKET", raising=False)
    shared = tmp_path / "run-flowsched"
    monkeypatch.setattr(rundir, "ROOT_DIR", str(shared))
    return shared


def _root_agent(shared: Path) -> AgentThread:
    """An agent serving ``shared`` (the root agent's directory of :func:`user_node`)."""
    return AgentThread(
        AgentConfig(
            node="n1",
            socket_path=str(shared / rundir.SOCKET_NAME),
            table_path=str(shared / rundir.TABLE_NAME),
            num_slots=8,
            metrics_port=None,
            fallback_after=60.0,
            interfaces=("lo",),
        )
    )


def test_a_users_flow_opened_before_any_agent_finds_a_root_agent_started_later(
    user_node: Path, tmp_path: Path
) -> None:
    # a user's job on a node that boots: no agent anywhere when its flow opens, so the default
    # path is the user's own; the root agent that starts then serves /run/flowsched
    with client.flow("kv", bytes=1000) as handle:
        assert not handle.connected
        assert client.default_socket_path() == f"{tmp_path}/xdg/flowsched/agent.sock"
        with _root_agent(user_node) as running:
            _wait(lambda: handle.connected, timeout=5.0)
            registry = running.agent.registry
            assert registry is not None
            assert registry.flows[handle.id].size == 1000  # type: ignore[index]


def test_consumer_step_defaults_to_the_last_reported_job(agent: AgentThread) -> None:
    path = agent.ready.socket  # type: ignore[union-attr]
    client.job_progress("train-3", 7, socket_path=path)
    with client.flow("experience", consumer_step=9, socket_path=path) as handle:
        flow = agent.agent.registry.flows[handle.id]  # type: ignore[union-attr, index]
        assert (flow.job, flow.consumer_index) == (f"{os.geteuid()}/train-3", 9)


def test_send_with_flow_names_the_destination(agent: AgentThread) -> None:
    """flowsched.transfer opens the SDK flow with dst_node and sends the bytes intact."""
    from flowsched import transfer

    registry = agent.agent.registry
    assert registry is not None
    opened: list[tuple[str, ...]] = []
    original = registry.open_sdk

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        flow, linked = original(*args, **kwargs)
        opened.append(flow.links)
        return flow, linked

    registry.open_sdk = recording  # type: ignore[method-assign]
    with transfer.Receiver(("127.0.0.1", 0)) as receiver:
        stats = transfer.send_with_flow(
            receiver.address,
            200_000,
            "kv",
            deadline=time.time() + 10,
            dst_node="h2",
            socket_path=agent.ready.socket,  # type: ignore[union-attr]
        )
        result = receiver.results.get(timeout=5)
    assert result.ok and stats.bytes == 200_000
    assert opened == [("n1:tx", "h2:rx")]


@pytest.mark.parametrize(
    ("job", "step", "layer"), [("a\nb", 1, None), ("", 1, None), ("j", -1, None), ("j", 1, -2)]
)
def test_job_progress_refuses_what_the_coordinator_would(
    job: str, step: int, layer: int | None
) -> None:
    with pytest.raises(ValueError, match="job must be"):
        client.job_progress(job, step, layer, socket_path="/nonexistent/agent.sock")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"deadline": float("inf")}, "deadline", id="infinite-deadline"),
        pytest.param({"deadline": float("nan")}, "deadline", id="nan-deadline"),
        pytest.param({"deadline": True}, "deadline", id="bool-deadline"),
        pytest.param({"deadline": 20.0}, "deadline", id="relative-deadline"),
        pytest.param({"deadline": 0}, "deadline", id="zero-deadline"),
        pytest.param({"bytes": True}, "bytes", id="bool-bytes"),
        pytest.param({"bytes": 2**64}, "bytes", id="bytes-beyond-u64"),
        pytest.param({"peer": 2**31}, "peer", id="peer-beyond-i32"),
        pytest.param({"consumer_step": 2**63, "job": "j"}, "consumer_step", id="step-beyond-i64"),
        pytest.param({"dst_node": "n" * 129}, "dst_node", id="dst-node-too-long"),
        pytest.param({"dst_node": " h2"}, "dst_node", id="dst-node-blank"),
    ],
)
def test_open_refuses_what_the_agent_decoder_refuses(
    kwargs: dict[str, object], field: str, tmp_path: Path
) -> None:
    request = sdk.Open(0, "kv", **{_OPEN_FIELDS.get(k, k): v for k, v in kwargs.items()})  # type: ignore[arg-type]
    # the agent would drop the connection (a count beyond u64 cannot even be encoded)
    with pytest.raises((sdk.SdkProtocolError, OverflowError)):
        sdk.decode_body(sdk.encode(request)[4:], sdk.CLIENT_MESSAGES)
    with pytest.raises(ValueError, match=f"^{field}"):
        client.open_flow("kv", socket_path=str(tmp_path / "x"), **kwargs)  # type: ignore[arg-type]


_OPEN_FIELDS = {"bytes": "size", "consumer_step": "consumer_index"}


def _send_with_flow(**kwargs: Any) -> object:
    from flowsched import transfer

    return transfer.send_with_flow(("127.0.0.1", 9), 10, "kv", **kwargs)


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(lambda **kw: client.open_flow("kv", **kw), id="open_flow"),
        pytest.param(lambda **kw: client.flow("kv", **kw).__enter__(), id="flow"),
        pytest.param(lambda **kw: _send_with_flow(**kw), id="send_with_flow"),
    ],
)
@pytest.mark.parametrize("deadline", [20.0, 20, 999_999_999.9])
def test_a_relative_deadline_is_refused_by_every_entry_that_takes_one(
    entry: Any, deadline: float, tmp_path: Path
) -> None:
    """``deadline=20.0`` meant as "20 s from now" was taken as a time in 1970: long missed,
    the flow stayed at level 0 for good (every other flow behind it)."""
    with pytest.raises(ValueError, match=r"^deadline .*seconds since the epoch") as info:
        entry(deadline=deadline, socket_path=str(tmp_path / "x"))
    assert "time.time() + 20" in str(info.value)


def test_the_agent_refuses_a_relative_deadline_naming_the_field(agent: AgentThread) -> None:
    """A client that does not check (another language's, an older one) is told by the agent,
    in an error frame naming the field, rather than served a flow at level 0 forever."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(agent.ready.socket)  # type: ignore[union-attr]
        sock.sendall(sdk.encode(sdk.Open(1, "kv", 1000, 20.0)))
        decoder = sdk.SdkDecoder("client")
        while (answer := decoder.next_message()) is None:
            data = sock.recv(65536)
            assert data, "the agent closed the connection without saying why"
            decoder.feed(data)
    assert isinstance(answer, sdk.Error) and answer.code == "bad_frame"
    assert answer.reason.startswith("open.deadline: expected wall-clock seconds since the epoch")
    registry = agent.agent.registry
    assert registry is not None and not registry.sdk  # no flow opened


def test_job_progress_refuses_a_step_beyond_the_protocol() -> None:
    with pytest.raises(ValueError, match="job must be"):
        client.job_progress("j", 2**63, socket_path="/nonexistent/agent.sock")


def test_a_path_that_is_the_default_shares_the_default_connection(
    fresh_sdk_connections: None,
) -> None:
    assert client.connection(client.default_socket_path()) is client.connection()


def test_each_place_tried_says_once_why_it_was_not_used(
    user_node: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # first no agent anywhere; then /run/flowsched appears, but writable by everyone
    caplog.set_level(logging.WARNING, logger="flowsched.client")
    conn = client.connection()
    assert not conn.ensure_connected()
    assert "no flowsched agent at" in caplog.text
    user_node.mkdir()
    user_node.chmod(0o777)
    (user_node / rundir.SOCKET_NAME).touch()
    monkeypatch.setattr(conn, "_last_attempt", -client.RECONNECT_INTERVAL)
    assert not conn.ensure_connected()
    assert f"not using the flowsched agent socket {user_node / rundir.SOCKET_NAME}" in caplog.text


def test_a_socket_left_by_a_killed_user_agent_does_not_hide_the_root_agent(
    user_node: Path, tmp_path: Path
) -> None:
    own = tmp_path / "xdg" / "flowsched"
    own.mkdir(parents=True, mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(own / rundir.SOCKET_NAME))  # bound, never listening: connections refused
    try:
        with _root_agent(user_node), client.flow("kv", bytes=10) as handle:
            assert handle.connected
            assert client.connection().path == str(user_node / rundir.SOCKET_NAME)
    finally:
        stale.close()


def test_a_flow_opened_on_a_connection_another_call_remade_is_not_opened_twice(
    tmp_path: Path,
) -> None:
    """After an agent restart the application's own calls (here ``job_progress``) may make
    the new connection before the reconnect thread wakes; a flow opened on it has an id, and
    the reconnect thread must not open it a second time (the first would stay open at the
    agent, unowned, until the process disconnects)."""
    config = _restartable_agent(tmp_path)
    first = AgentThread(config)
    first.start()
    try:
        old = client.open_flow("param_sync", bytes=100, socket_path=config.socket_path)
        conn = client.connection(config.socket_path)
        # the next connection attempt is not held back by the first one's
        _wait(lambda: time.monotonic() - conn._last_attempt >= client.RECONNECT_INTERVAL)
        conn._reconnecting = True  # the reconnect thread is held until the new flow is open
        first.stop()
        _wait(lambda: old.id is None)
        with AgentThread(config) as second:
            registry = second.agent.registry
            assert registry is not None
            assert client.job_progress("j", 1, socket_path=config.socket_path)
            new = client.open_flow("kv", bytes=100, socket_path=config.socket_path)
            assert new.connected
            conn._reconnecting = False
            conn._start_reconnecting()  # it wakes a second later, the connection made
            _wait(lambda: old.connected)
            assert second.run(lambda: sorted(registry.sdk)) == sorted([old.id, new.id])
            old.close()
            new.close()
            _wait(lambda: second.run(lambda: not registry.sdk))
    finally:
        _drop_connection(config.socket_path)


def test_a_flow_whose_connection_ended_before_it_was_tracked_is_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent answers the open and goes away before ``open_flow`` tracks the handle: the
    dropped connection resets the ids of the tracked handles only, so this one kept the dead
    connection's id, and the reconnect thread, which re-opens only flows without an id, never
    re-opened it at the restarted agent (no level pushes, a close for an id it never gave)."""
    config = _restartable_agent(tmp_path)
    first = AgentThread(config)
    first.start()
    track = client.AgentConnection.track

    def track_after_the_agent_left(self: client.AgentConnection, handle: client.FlowHandle) -> None:
        assert handle.id is not None  # answered by the first agent
        first.stop()
        _wait(lambda: self._sock is None)  # the reader saw the connection end
        track(self, handle)

    try:
        monkeypatch.setattr(client.AgentConnection, "track", track_after_the_agent_left)
        handle = client.open_flow("param_sync", bytes=100, socket_path=config.socket_path)
        monkeypatch.setattr(client.AgentConnection, "track", track)
        with AgentThread(config) as second:
            registry = second.agent.registry
            assert registry is not None
            _wait(lambda: second.run(lambda: list(registry.sdk)) == [handle.id])
            handle.close()
            _wait(lambda: second.run(lambda: not registry.sdk))
    finally:
        _drop_connection(config.socket_path)


def test_a_connection_refused_while_flows_are_reopened_is_retried(
    agent: AgentThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user at its connection cap: the reconnect thread's new connection is refused (an
    ``error`` frame, then the close) while it re-opens the flows. The reader thread that sees
    the close asks for a reconnect while that thread still runs, so the request was dropped and
    the thread ended: the flow stayed on static defaults for good, never retried once the cap
    had room (docs/security.md: it retries once a second while it has flows). The test holds
    the reconnect thread in its re-open until the refused connection's drop is done, the order
    that lost the retry (two of three unheld runs lost it)."""
    path = agent.ready.socket  # type: ignore[union-attr]
    sdk_server = agent.agent.sdk
    assert sdk_server is not None
    agent.run(lambda: setattr(sdk_server, "max_connections_per_uid", 1))
    made: list[socket.socket] = []  # the connections the SDK made, newest last
    ended: list[socket.socket] = []  # those whose drop has returned
    connect, drop, reopen = (
        client.AgentConnection._connect,
        client.AgentConnection._drop,
        client.AgentConnection._reopen,
    )

    def connect_and_tell(self: client.AgentConnection, where: str) -> socket.socket | None:
        sock = connect(self, where)
        if sock is not None:
            made.append(sock)
        return sock

    def drop_and_tell(self: client.AgentConnection, sock: socket.socket, **kw: bool) -> None:
        drop(self, sock, **kw)
        ended.append(sock)

    def reopen_until_dropped(self: client.AgentConnection, handle: client.FlowHandle) -> None:
        reopen(self, handle)
        sock = made[-1]  # the connection this re-open went over
        _wait(lambda: handle.connected or any(s is sock for s in ended), timeout=10.0)

    monkeypatch.setattr(client.AgentConnection, "_connect", connect_and_tell)
    monkeypatch.setattr(client.AgentConnection, "_drop", drop_and_tell)
    monkeypatch.setattr(client.AgentConnection, "_reopen", reopen_until_dropped)
    blocker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    blocker.connect(path)  # the user's one connection (counted before its first byte)
    try:
        _wait(lambda: agent.run(lambda: sdk_server._connections_of.get(os.geteuid())) == 1)
        handle = client.open_flow("kv", socket_path=path)
        assert not handle.connected  # refused: static defaults
        _wait(lambda: sdk_server.refused_total >= 3, timeout=10.0)  # retried while refused
    finally:
        blocker.close()
    _wait(lambda: handle.connected, timeout=10.0)  # and taken once the cap has room
    handle.close()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({"bytes": "int64"}, {"size": 1000}, id="numpy-bytes"),
        pytest.param({"deadline": "float64"}, {"deadline": 4.0e9}, id="numpy-float64-deadline"),
        pytest.param({"deadline": "float32"}, {"deadline": 4.0e9}, id="numpy-float32-deadline"),
        pytest.param({"consumer_step": "int32"}, {"consumer_index": 7}, id="numpy-step"),
        pytest.param({"peer": "int64"}, {"peer": 3}, id="numpy-peer"),
    ],
)
def test_numpy_numbers_are_taken_as_the_numbers_they_hold(
    kwargs: dict[str, str], expected: dict[str, object], agent: AgentThread
) -> None:
    """A size, deadline or step computed with numpy (``np.prod(shape) * 4``, ``time.time() +
    np.mean(pace)``) is a plain number to the application: the SDK takes it as one."""
    np = pytest.importorskip("numpy")
    plain = {"bytes": 1000, "deadline": 4.0e9, "consumer_step": 7, "peer": 3}
    numpy_kwargs = {name: getattr(np, kind)(plain[name]) for name, kind in kwargs.items()}
    path = agent.ready.socket  # type: ignore[union-attr]
    assert client.job_progress("train-np", np.int64(5), np.int32(2), socket_path=path)
    with client.flow("experience", job="train-np", socket_path=path, **numpy_kwargs) as handle:
        assert handle.connected
        registry = agent.agent.registry
        assert registry is not None and handle.id is not None
        flow, sdk_flow = registry.flows[handle.id], registry.sdk[handle.id]
        for name, value in expected.items():
            got = getattr(sdk_flow if name == "peer" else flow, name)
            assert got == value and type(got) is type(value)
