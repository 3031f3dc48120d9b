"""End to end with a real etcd: three coordinators elect one, agents with plugin traffic follow
it; kill -9 of the leader during the transfers, then SIGTERM of its successor.

Measured and printed (run with ``-s``): time from the kill until a standby leads, and until
every agent is back under global decisions (connected to the new leader, which rebuilt the
flow table from their resyncs); the graceful handover time. Checked: every byte arrives
(byte-exact, verified by the receiver), the epoch only grows, never two coordinators claim
leadership at one time, the killed leader's successor sends with the higher epoch. A paused
(SIGSTOP) leader is replaced once its lease expires and, resumed, exits without the agent ever
following it again. A live leader that the agents cannot reach (its address, as they see it,
takes connections and never answers) is deposed by the standby they reach; one that turns
agents away at its connection caps is not (they reach it). After etcd is rebuilt empty, the
agent follows the new leader although its epoch is below the old one's.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from pathlib import Path

import pytest
from ha_helpers import (
    Daemon,
    emulated_plugin,
    etcd_call,
    leads,
    need_etcd,
    start_agent,
    start_coordinator,
    total,
    wait_for,
)

from flowsched import transfer
from flowsched.coordinator.election import _b64
from flowsched.protocol import write_token
from flowsched.shm import layout
from flowsched.shm.table import FlowTable
from flowsched.testbed.daemons import agent_in_session, free_ports
from flowsched.testbed.etcd import local_etcd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

AGENTS = 2
#: generous: these are behaviour checks on a shared machine; the figures are printed
DEADLINE = 15.0


def _leaders(coordinators: list[Daemon]) -> list[tuple[Daemon, int]]:
    """(coordinator, epoch) of every live coordinator whose metrics say it leads."""
    found = []
    for coordinator in coordinators:
        if coordinator.proc.poll() is not None:
            continue
        metrics = coordinator.metrics()
        if total(metrics, "flowsched_coordinator_leader") == 1:
            found.append((coordinator, int(total(metrics, "flowsched_coordinator_epoch"))))
    return found


def _back_under(leader: Daemon, flows: float, tables: list[FlowTable]) -> bool:
    metrics = leader.metrics()
    return (
        total(metrics, "flowsched_coordinator_leader") == 1
        and total(metrics, "flowsched_coordinator_agents_connected") == AGENTS
        and total(metrics, "flowsched_coordinator_active_flows") >= flows
        and all(t.flags() & layout.FLAG_COORDINATOR_CONNECTED for t in tables)
    )


def _one_leader(coordinators: list[Daemon], history: list[int]) -> Daemon | None:
    leaders = _leaders(coordinators)
    assert len(leaders) <= 1, f"two coordinators lead at once: {leaders}"
    if leaders:
        history.append(leaders[0][1])
        return leaders[0][0]
    return None


def test_kill9_leader_standby_takes_over_without_losing_bytes(
    tmp_path: Path, etcd_url: str
) -> None:
    token = tmp_path / "token"
    write_token(token)
    started: list[Daemon] = []
    plugins = []
    tables: list[FlowTable] = []
    epochs: list[int] = []
    try:
        with transfer.Receiver(timeout=30) as rx:
            coordinators = [
                start_coordinator(tmp_path, token, etcd_url, f"coord{i}") for i in range(3)
            ]
            started += coordinators
            wait_for(lambda: _one_leader(coordinators, epochs), DEADLINE, "a leader")
            agents = [start_agent(tmp_path, token, coordinators, f"n{i}") for i in range(AGENTS)]
            started += agents
            tables = [FlowTable.open(a.fields["table"]) for a in agents]
            for agent in agents:
                plugins.append(
                    emulated_plugin(
                        tmp_path, agent.fields["table"], rx.address, agent.name, 300, 0.02
                    )
                )
            leader = _one_leader(coordinators, epochs)
            assert leader is not None
            wait_for(lambda: _back_under(leader, AGENTS, tables), DEADLINE, "agents on it")
            first_epoch = epochs[-1]

            killed = time.monotonic()
            leader.kill9()
            rest = [c for c in coordinators if c is not leader]
            wait_for(lambda: _one_leader(rest, epochs), DEADLINE, "a standby to lead")
            leads = time.monotonic() - killed
            successor = _one_leader(rest, epochs)
            assert successor is not None
            wait_for(lambda: _back_under(successor, AGENTS, tables), DEADLINE, "agents back")
            back = time.monotonic() - killed
            assert epochs[-1] > first_epoch

            resigned = time.monotonic()
            successor.proc.send_signal(signal.SIGTERM)  # graceful: revokes its lease
            last = [c for c in rest if c is not successor]
            wait_for(lambda: _one_leader(last, epochs), DEADLINE, "the graceful handover")
            handover = time.monotonic() - resigned
            wait_for(lambda: _back_under(last[0], AGENTS, tables), DEADLINE, "agents back")
            handover_back = time.monotonic() - resigned
            assert successor.proc.wait(timeout=10) == 0
            assert epochs == sorted(epochs), epochs

            for plugin in plugins:
                assert plugin.wait(timeout=60) == 0
            reports = [json.loads((tmp_path / f"{a.name}.json").read_text()) for a in agents]
            results = []
            while len(results) < len(reports):
                results.append(rx.results.get(timeout=10))
        assert all(r["ok"] for r in reports), reports
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        sent = sum(r["bytes"] for r in reports)
        assert sum(r.bytes for r in results) == sent  # bytes lost: 0
        print(
            f"\nkill -9 leader: a standby led after {leads * 1e3:.0f} ms, every agent back "
            f"under global decisions after {back * 1e3:.0f} ms; SIGTERM of its successor: "
            f"handover {handover * 1e3:.0f} ms, agents back {handover_back * 1e3:.0f} ms; "
            f"{sent} bytes sent, 0 lost; epochs {sorted(set(epochs))}"
        )
    finally:
        for table in tables:
            table.close()
        for plugin in plugins:
            if plugin.poll() is None:
                plugin.kill()
                plugin.wait(timeout=10)
        for daemon in reversed(started):
            daemon.stop()


def test_a_paused_leader_is_replaced_and_exits_when_it_resumes(
    tmp_path: Path, etcd_url: str
) -> None:
    token = tmp_path / "token"
    write_token(token)
    started: list[Daemon] = []
    epochs: list[int] = []
    try:
        coordinators = [start_coordinator(tmp_path, token, etcd_url, f"c{i}") for i in range(2)]
        started += coordinators
        wait_for(lambda: _one_leader(coordinators, epochs), DEADLINE, "a leader")
        agent = start_agent(tmp_path, token, coordinators, "n0")
        started.append(agent)
        leader = _one_leader(coordinators, epochs)
        assert leader is not None
        first_epoch = epochs[-1]
        standby = next(c for c in coordinators if c is not leader)
        wait_for(
            lambda: total(leader.metrics(), "flowsched_coordinator_agents_connected") == 1,
            DEADLINE, "the agent on the leader",
        )  # fmt: skip

        leader.proc.send_signal(signal.SIGSTOP)  # alive, holding its sockets, silent
        paused = time.monotonic()
        wait_for(lambda: _one_leader([standby], epochs), DEADLINE, "the lease to expire")
        replaced = time.monotonic() - paused
        wait_for(
            lambda: total(standby.metrics(), "flowsched_coordinator_agents_connected") == 1,
            DEADLINE, "the agent on the new leader",
        )  # fmt: skip
        # the agent logs its session (read below) once it took the welcome, after that count
        wait_for(lambda: _follows(agent, standby), DEADLINE, "the agent's session on it")
        assert epochs[-1] > first_epoch

        leader.proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        assert leader.proc.wait(timeout=DEADLINE) == 1  # it found its lease gone and exited
        stepped_down = time.monotonic() - resumed
        log = (tmp_path / f"{leader.name}.log").read_text()
        assert "lost leadership" in log
        # the agent stayed with the new leader: never a session with the old epoch again
        agent_log = (tmp_path / "agent-n0.log").read_text()
        sessions = [
            int(e) for e in re.findall(r"connected to the coordinator \(epoch (\d+)\)", agent_log)
        ]
        assert sessions == sorted(sessions) and sessions[-1] == epochs[-1], sessions
        assert total(standby.metrics(), "flowsched_coordinator_agents_connected") == 1
        print(
            f"\nSIGSTOP of the leader: replaced after {replaced:.2f} s (lease TTL 2 s); after "
            f"SIGCONT it exited in {stepped_down * 1e3:.0f} ms; agent sessions by epoch {sessions}"
        )
    finally:
        for daemon in reversed(started):
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGCONT)
            daemon.stop()


def test_a_live_leader_the_agents_cannot_reach_is_deposed_by_the_standby_they_reach(
    tmp_path: Path, etcd_url: str
) -> None:
    token = tmp_path / "token"
    write_token(token)
    started: list[Daemon] = []
    # the leader's address as the agent sees it: connections are taken (by the kernel) and
    # never answered, as through a path that drops everything after the SYN; etcd reaches
    # the leader all along, so its lease lives
    with socket.socket() as tarpit:
        tarpit.bind(("127.0.0.1", 0))
        tarpit.listen(64)
        unreachable = f"127.0.0.1:{tarpit.getsockname()[1]}"
        try:
            leader = start_coordinator(tmp_path, token, etcd_url, "c0", "--advertise", unreachable)
            started.append(leader)
            wait_for(lambda: leads(leader), DEADLINE, "c0 to lead")
            standby = start_coordinator(tmp_path, token, etcd_url, "c1")
            started.append(standby)
            agent = start_agent(tmp_path, token, [standby], "n0")  # knows the standby alone
            started.append(agent)
            begun = time.monotonic()
            wait_for(
                lambda: total(standby.metrics(), "flowsched_coordinator_agents_connected") == 1,
                60, "the agent on the standby, leading",
            )  # fmt: skip
            took = time.monotonic() - begun
            assert leads(standby)
            assert total(standby.metrics(), "flowsched_coordinator_agents_cut_off_from_leader") == 0
            assert leader.proc.wait(timeout=DEADLINE) == 1  # it found its lease gone and exited
            said = (tmp_path / "c1.log").read_text()
            assert f"deposing the leader at {unreachable}" in said
            assert "cannot reach it, refused here for 5 s or more: 1 (n0); it serves 0" in said
            print(f"\nleader cut off from the agent: under the standby after {took:.2f} s")
        finally:
            for daemon in reversed(started):
                daemon.stop()


def test_a_leader_turning_agents_away_at_its_connection_cap_keeps_its_leadership(
    tmp_path: Path, etcd_url: str
) -> None:
    token = tmp_path / "token"
    write_token(token)
    started: list[Daemon] = []
    try:
        # an open-file limit of 97 leaves the leader room for one agent connection
        leader = start_coordinator(tmp_path, token, etcd_url, "c0", fd_limit=97)
        started.append(leader)
        wait_for(lambda: leads(leader), DEADLINE, "c0 to lead")
        standbys = [start_coordinator(tmp_path, token, etcd_url, f"c{i}") for i in (1, 2)]
        started += standbys
        coordinators = [leader, *standbys]
        agents = [start_agent(tmp_path, token, coordinators, f"n{i}") for i in range(3)]
        started += agents
        wait_for(
            lambda: total(leader.metrics(), "flowsched_coordinator_agents_connected") == 1,
            DEADLINE, "one agent on the leader",
        )  # fmt: skip
        # the other two reach the leader, are turned away, and knock on the standbys: once a
        # standby counts them as cut off (5 s of knocks), it reads the leader's reach at
        # each later knock (at most once a second); give it eight more refusals' worth
        wait_for(
            lambda: any(
                total(c.metrics(), "flowsched_coordinator_agents_cut_off_from_leader") >= 1
                for c in standbys
            ),
            30, "a standby counting the turned-away agents as cut off",
        )  # fmt: skip
        refused = 'flowsched_coordinator_closed_connections_total{reason="too_many_connections"}'
        before = leader.metrics().get(refused, 0.0)
        wait_for(lambda: leader.metrics().get(refused, 0.0) >= before + 8, 30, "more refusals")
        assert leads(leader) and leader.proc.poll() is None
        for coordinator in coordinators:
            said = (tmp_path / f"{coordinator.name}.log").read_text()
            assert "deposing the leader" not in said, coordinator.name
        assert "connection limit reached" in (tmp_path / f"{leader.name}.log").read_text()
    finally:
        for daemon in reversed(started):
            daemon.stop()


def test_agents_follow_the_leader_of_an_etcd_rebuilt_empty(tmp_path: Path) -> None:
    """etcd rebuilt empty with the same member and token keeps its cluster id while its
    revisions start over: the new leader's epoch is below the one the agent followed, and
    the agent follows it all the same (a new fencing scope), without any deposition."""
    need_etcd()
    token = tmp_path / "token"
    write_token(token)
    ports = free_ports(2)
    started: list[Daemon] = []
    try:
        with local_etcd(tmp_path / "etcd.log", data_dir=tmp_path / "etcd-a", ports=ports) as url:
            for i in range(40):  # revisions well above the rebuilt cluster's first ones
                before = etcd_call(url, "kv/put", _put(f"/other/{i}"))["header"]
            leader = start_coordinator(tmp_path, token, url, "c0")
            standby = start_coordinator(tmp_path, token, url, "c1")
            started += [leader, standby]
            agent = start_agent(tmp_path, token, [leader, standby], "n0")
            started.append(agent)
            wait_for(lambda: _follows(agent, leader), DEADLINE, "the agent on c0")
            followed = int(total(leader.metrics(), "flowsched_coordinator_epoch"))
            assert followed > 40
        # etcd is gone: c0 steps down and exits, c1 campaigns in vain until etcd is back
        assert leader.proc.wait(timeout=DEADLINE) == 1
        with local_etcd(tmp_path / "etcd.log", data_dir=tmp_path / "etcd-b", ports=ports) as url:
            after = etcd_call(url, "kv/put", _put("/other/0"))["header"]
            assert after["cluster_id"] == before["cluster_id"]  # type: ignore[index]
            wait_for(
                lambda: _follows(agent, standby), 30, "the agent on c1, leading the rebuilt etcd"
            )  # fmt: skip
            assert 0 < total(standby.metrics(), "flowsched_coordinator_epoch") < followed
            said = (tmp_path / "agent-n0.log").read_text()
            assert "a deposed leader, not followed" not in said
    finally:
        for daemon in reversed(started):
            daemon.stop()


def _put(key: str) -> dict[str, str]:
    """An etcd put of ``key`` (any value)."""
    return {"key": _b64(key), "value": _b64("x")}


def _follows(agent: Daemon, coordinator: Daemon) -> bool:
    """Whether ``agent`` holds a session with ``coordinator``, leading: the coordinator counts
    an agent from its handshake on, the agent itself only once it took the welcome."""
    metrics = coordinator.metrics()
    return (
        total(metrics, "flowsched_coordinator_leader") == 1
        and total(metrics, "flowsched_coordinator_agents_connected") == 1
        and agent_in_session(agent)
    )
