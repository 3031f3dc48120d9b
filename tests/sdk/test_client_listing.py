"""``client.list_flows`` (what ``flowsched flows`` shows of the SDK) against a real agent, an
agent that does not know the request, and one that never answers."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import timeit
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from polling import wait_until

from flowsched import client
from flowsched.agent.threaded import AgentThread
from flowsched.model import FlowClass
from flowsched.protocol import sdk
from flowsched.shm.table import EmulatedPluginSlot, FlowTable


def _path(agent: AgentThread) -> str:
    assert agent.ready is not None
    return agent.ready.socket


def test_a_flow_is_listed_as_it_was_opened_and_leaves_the_list_when_closed(
    agent: AgentThread,
) -> None:
    path = _path(agent)
    deadline = time.time() + 30
    with client.flow(
        "kv", bytes=5000, deadline=deadline, job="serve", request="r1", consumer_step=3,
        dst_node="h2", socket_path=path,
    ) as handle:  # fmt: skip
        handle.progress(1200)
        registry = agent.agent.registry
        assert registry is not None
        wait_until(lambda: registry.flows[handle.id].sent == 1200)  # type: ignore[index]
        listing = client.list_flows(path)
        assert listing.path == path and listing.everyone  # this user runs the agent
        [info] = listing.flows
        assert (info.id, info.cls, info.pid, info.uid) == (handle.id, "kv", os.getpid(),
                                                          os.geteuid())  # fmt: skip
        # names as the application gave them (the agent scopes them to the uid internally)
        assert (info.job, info.request, info.consumer_index, info.dst_node) == ("serve", "r1", 3,
                                                                                 "h2")  # fmt: skip
        assert (info.size, info.sent, info.deadline) == (5000, 1200, deadline)
        assert info.level in (None, handle.level) and info.slots == ()
        assert 0 <= time.time() - info.opened_at < 30
    wait_until(lambda: client.list_flows(path).flows == ())


def test_the_class_default_deadline_is_listed_when_the_flow_gave_none(agent: AgentThread) -> None:
    path = _path(agent)
    default = agent.agent.view.default_deadline(FlowClass.PARAM_SYNC)
    with client.flow("param_sync", socket_path=path):
        [info] = client.list_flows(path).flows
    if default is None:
        assert info.deadline is None
    else:
        assert info.deadline == pytest.approx(info.opened_at + default)


def test_many_flows_come_in_pages_each_once_oldest_first(agent: AgentThread) -> None:
    path = _path(agent)
    long_job = "j" * 200  # ~230 bytes a flow: 400 of them take two frames
    handles = [client.open_flow("bulk", job=long_job, socket_path=path) for _ in range(400)]
    try:
        sdk_server = agent.agent.sdk
        assert sdk_server is not None
        first = agent.run(lambda: sdk_server.flow_page(os.geteuid(), None))
        assert first.more and 0 < len(first.flows) < 400
        listed = client.list_flows(path).flows
        assert [info.id for info in listed] == sorted(h.id for h in handles)  # type: ignore[type-var]
    finally:
        for handle in handles:
            handle.close()


def test_the_connections_that_carry_a_flow_are_named(agent: AgentThread) -> None:
    assert agent.ready is not None
    with FlowTable.open(agent.ready.table, writable=True) as table:
        carrier = EmulatedPluginSlot(table, class_id=int(FlowClass.EXPERIENCE), peer_rank=1)
        EmulatedPluginSlot(table, class_id=int(FlowClass.EXPERIENCE), peer_rank=2)  # not to peer 1
        registry = agent.agent.registry
        assert registry is not None
        wait_until(lambda: len(registry.slots) == 2)
        with client.flow("experience", job="rl", peer=1, socket_path=_path(agent)):
            [info] = client.list_flows(_path(agent)).flows
            assert info.slots == ((carrier.index, carrier.claim_seq),)
            assert info.peer == 1


# -- agents that cannot answer ------------------------------------------------------------------


@pytest.fixture
def fake_agent(tmp_path: Path) -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """Serve one connection at a socket under ``tmp_path`` with a given behaviour; returns
    the path. The server thread is joined at the end."""
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []

    def serve(behaviour: Callable[[socket.socket], None]) -> str:
        directory = tmp_path / "fake"
        directory.mkdir(mode=0o700)
        path = str(directory / "agent.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(10)
        listeners.append(listener)

        def run() -> None:
            conn, _ = listener.accept()
            with conn:
                behaviour(conn)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        return path

    yield serve
    for thread in threads:
        thread.join(10)
    for listener in listeners:
        listener.close()


def _answer_unknown_type(conn: socket.socket) -> None:
    """What an agent of an earlier release does with ``list``: a bad_frame error, then close."""
    conn.recv(65536)
    conn.sendall(sdk.encode(sdk.Error("bad_frame", "unknown or unexpected message type 'list'")))


def _never_answer(conn: socket.socket) -> None:
    conn.recv(65536)
    conn.settimeout(10)
    conn.recv(65536)  # until the client gives up and closes


def _garble(conn: socket.socket) -> None:
    conn.recv(65536)
    conn.sendall(b"\x00\x00\x00\x02\xc1\xc1")


def test_an_older_agent_is_said_to_be_older(fake_agent) -> None:  # type: ignore[no-untyped-def]
    path = fake_agent(_answer_unknown_type)
    with pytest.raises(client.AgentUnavailable, match=r"does not list flows.*older") as caught:
        client.list_flows(path)
    assert caught.value.problem == "refused"


def test_an_agent_that_never_answers_costs_the_timeout_only(fake_agent) -> None:  # type: ignore[no-untyped-def]
    path = fake_agent(_never_answer)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        client.list_flows(path, timeout=0.3)
    assert time.monotonic() - started < 5


def test_an_undecodable_answer_is_named(fake_agent) -> None:  # type: ignore[no-untyped-def]
    path = fake_agent(_garble)
    with pytest.raises(client.AgentUnavailable, match="sent a bad frame"):
        client.list_flows(path)


def test_no_agent_names_the_path(tmp_path: Path) -> None:
    path = str(tmp_path / "none" / "agent.sock")
    with pytest.raises(client.AgentUnavailable, match=f"no flowsched agent at {path}") as caught:
        client.list_flows(path)
    assert caught.value.problem == "absent"


def _open_many(path: str, count: int, job: str) -> socket.socket:
    """A connection holding ``count`` flows, opened at once (their answers left unread)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(b"".join(sdk.encode(sdk.Open(i, "bulk", job=job)) for i in range(count)))
    return sock


def test_a_user_who_may_not_see_the_others_flows_does_not_walk_them(agent: AgentThread) -> None:
    registry, sdk_server = agent.agent.registry, agent.agent.sdk
    assert registry is not None and sdk_server is not None
    with _open_many(_path(agent), 2000, "mine"):
        wait_until(lambda: len(registry.sdk) == 2000)
        other = os.geteuid() + 12345  # neither root nor the agent's user
        assert agent.run(lambda: sdk_server.flow_page(other, None)).flows == ()
        # each page looks at the asker's own flows only: 2,000 asks of a user with none cost
        # next to nothing (walking the node's 2,000 flows each time took seconds)
        took = agent.run(
            lambda: timeit.timeit(lambda: sdk_server.flow_page(other, None), number=2000)
        )
        assert took < 1.0


def test_list_requests_of_a_client_that_reads_nothing_stop_costing_once_it_is_dropped(
    agent: AgentThread,
) -> None:
    sdk_server = agent.agent.sdk
    assert sdk_server is not None
    asks = 5000
    with _open_many(_path(agent), 300, "j" * 200) as sock:  # a page is a whole 64 KiB frame
        wait_until(lambda: sdk_server.requests["open"] == 300)
        started = time.monotonic()
        sock.sendall(sdk.encode(sdk.ListFlows()) * asks)
        wait_until(lambda: sdk_server.clients == 0, timeout=10)
        # the agent dropped it after about 16 pages (MAX_CLIENT_BACKLOG): the other asks are
        # neither answered nor read, so not computed (each took milliseconds: 5,000 held the
        # agent ~10 s)
        assert time.monotonic() - started < 3.0
        assert sdk_server.requests["list"] < asks


def _refuse_at_once(conn: socket.socket) -> None:
    """What the agent does at its connection caps: an error frame, then close, before the
    client's request is read (the client may find the connection closed as it sends)."""
    conn.sendall(
        sdk.encode(sdk.Error("too_many_connections", "at most 256 SDK connections per user"))
    )


def test_a_refused_connection_says_what_the_agent_said(fake_agent) -> None:  # type: ignore[no-untyped-def]
    path = fake_agent(_refuse_at_once)
    with pytest.raises(client.AgentUnavailable) as caught:
        client.list_flows(path)
    assert caught.value.problem == "refused"
    assert "older" not in str(caught.value)
    assert re.search(r"too_many_connections|closed the connection", str(caught.value))


def test_a_connection_closed_before_the_request_is_sent_is_an_unavailable_agent(
    fake_agent,  # type: ignore[no-untyped-def]
) -> None:
    closed = threading.Event()
    path = fake_agent(lambda conn: closed.set())  # accepted, then closed unread
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    assert closed.wait(10)
    time.sleep(0.05)  # the server's end is closed now
    with sock, pytest.raises(client.AgentUnavailable, match="closed the connection"):
        client._ask_pages(sock, path, time.monotonic() + 2)


def test_a_user_over_its_listing_rate_is_told_so(
    agent: AgentThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    sdk_server = agent.agent.sdk
    assert sdk_server is not None
    monkeypatch.setattr(sdk_server, "_may_list", lambda uid: False)  # its budget is spent
    with pytest.raises(client.AgentUnavailable, match="too_many_requests") as caught:
        client.list_flows(_path(agent))
    assert caught.value.problem == "refused"


def test_closed_flows_leave_no_trace_in_the_per_user_index(agent: AgentThread) -> None:
    sdk_server = agent.agent.sdk
    assert sdk_server is not None
    path = _path(agent)
    with client.flow("bulk", job="a", socket_path=path):
        assert agent.run(lambda: sum(map(len, sdk_server._opened_of.values()))) == 1
    wait_until(lambda: not agent.run(lambda: sdk_server._opened))
    assert agent.run(lambda: dict(sdk_server._opened_of)) == {}
    with _open_many(path, 5, "b"):  # closed by the client's disconnect
        wait_until(lambda: agent.run(lambda: len(sdk_server._opened)) == 5)
    wait_until(lambda: not agent.run(lambda: sdk_server._opened))
    assert agent.run(lambda: dict(sdk_server._opened_of)) == {}


def _refuse_then_close(conn: socket.socket) -> None:
    _refuse_at_once(conn)
    conn.shutdown(socket.SHUT_RDWR)


def test_what_an_agent_said_before_it_closed_is_quoted(fake_agent) -> None:  # type: ignore[no-untyped-def]
    """The client finds the connection closed as it sends its request: the error frame the
    agent sent first is read and quoted (not just "Broken pipe")."""
    closed = threading.Event()
    path = fake_agent(lambda conn: (_refuse_then_close(conn), closed.set()))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    assert closed.wait(10)
    time.sleep(0.05)
    with sock, pytest.raises(client.AgentUnavailable, match="too_many_connections"):
        client._ask_pages(sock, path, time.monotonic() + 2)


def test_a_listing_keeps_to_its_timeout_across_places(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each place tried gets what is left of the timeout, not a whole one; when it runs out,
    what the first place said is the answer (more telling than a bare timeout)."""
    given: list[float] = []

    def slow_absent(path: str, timeout: float) -> socket.socket:
        given.append(timeout)
        time.sleep(min(timeout, 0.3))  # a connect that hangs until its timeout, or 0.3 s
        raise client.AgentUnavailable(f"no flowsched agent at {path}", "absent")

    monkeypatch.setattr(client, "_connect_trusted", slow_absent)
    monkeypatch.setattr(client.rundir, "client_paths", lambda *_: ["/a", "/b", "/c", "/d"])
    started = time.monotonic()
    with pytest.raises(client.AgentUnavailable, match="no flowsched agent at /a"):
        client.list_flows(timeout=0.5)
    assert time.monotonic() - started < 0.75
    assert len(given) == 2 and given[0] == pytest.approx(0.5, abs=0.05)
    assert given[1] == pytest.approx(0.2, abs=0.05)
