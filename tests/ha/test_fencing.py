"""Fencing and redirects between a real agent and in-process coordinators whose leadership is
set by the test (no etcd): an agent follows the leader a standby names, refuses a coordinator
whose epoch is below one it already followed, and drops levels stamped with a stale epoch."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flowsched.agent import AgentConfig
from flowsched.agent.service import Agent, _redirect
from flowsched.agent.threaded import AgentThread
from flowsched.cli.agent import host_ports
from flowsched.coordinator import Coordinator, CoordinatorConfig
from flowsched.coordinator.election import Leadership
from flowsched.model import FlowClass
from flowsched.protocol import write_token
from flowsched.protocol.aio import HandshakeError
from flowsched.shm.table import EmulatedPluginSlot, FlowTable
from flowsched.testbed.daemons import closed_port

CLUSTER = 4242


class SetLeadership:
    """Stands in for :class:`~flowsched.coordinator.election.Candidacy`: the test decides."""

    def __init__(self, epoch: int | None, redirect: str | None = None) -> None:
        self.leadership = None if epoch is None else Leadership(epoch, CLUSTER, 1)
        self.redirect = redirect

    @property
    def epoch(self) -> int:
        return self.leadership.epoch if self.leadership is not None else 0

    @property
    def cluster(self) -> int:
        return CLUSTER if self.leadership is not None else 0

    def refusal(self, node: str | None = None) -> str | None:
        if self.leadership is not None:
            return None
        return self.redirect or "no leader elected yet"


class CoordinatorThread:
    """A coordinator with the default policy on its own loop in a daemon thread."""

    def __init__(self, token: bytes, leadership: SetLeadership) -> None:
        config = CoordinatorConfig.from_policy_file(None, token, metrics_port=None)
        self.coordinator = Coordinator(config, registry=CollectorRegistry())
        self.coordinator.candidacy = leadership  # type: ignore[assignment]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> int:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self.coordinator.start(), self._loop)
        return future.result(10).port

    def agents(self) -> int:
        return self.call(self.coordinator.agent_count)

    def call(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.coordinator.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def wait_until(predicate: Any, timeout: float = 8.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture
def token(tmp_path: Path) -> tuple[bytes, Path]:
    path = tmp_path / "token"
    return write_token(path), path


@pytest.fixture
def started() -> Iterator[list[Any]]:
    items: list[Any] = []
    try:
        yield items
    finally:
        for item in reversed(items):
            item.stop()


def _agent_config(tmp_path: Path, token_file: Path, ports: list[int]) -> AgentConfig:
    addresses = [("127.0.0.1", port) for port in ports]
    return AgentConfig(
        node="n1",
        socket_path=str(tmp_path / "agent.sock"),
        table_path=str(tmp_path / "table"),
        coordinator=addresses[0],
        coordinators=tuple(addresses[1:]),
        token_file=str(token_file),
        num_slots=16,
        metrics_port=None,
        interfaces=("lo",),
        reconnect_interval=0.05,
        connect_timeout=1.0,
    )


def _agent(tmp_path: Path, token_file: Path, ports: list[int]) -> AgentThread:
    return AgentThread(_agent_config(tmp_path, token_file, ports))


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("leader=10.0.0.1:7711 epoch=5", ("10.0.0.1", 7711)),
        ("leader=[fd00::1]:7711 epoch=5", ("fd00::1", 7711)),
        ("no leader elected yet", None),
        ("leader=nohost epoch=5", None),
        ("leader=:7711", None),
    ],
)
def test_redirect_is_read_from_the_refusal(reason: str, expected: tuple[str, int] | None) -> None:
    assert _redirect(HandshakeError("not_leader", reason)) == expected


def test_agent_flag_takes_several_coordinators() -> None:
    assert host_ports("a:1,[::1]:2, c:3") == [("a", 1), ("::1", 2), ("c", 3)]


def test_a_standby_redirects_the_agent_to_the_leader(
    tmp_path: Path, token: tuple[bytes, Path], started: list[Any]
) -> None:
    leader = CoordinatorThread(token[0], SetLeadership(7))
    started.append(leader)
    leader_port = leader.start()
    standby = CoordinatorThread(
        token[0], SetLeadership(None, f"leader=127.0.0.1:{leader_port} epoch=7")
    )
    started.append(standby)
    standby_port = standby.start()
    agent = _agent(tmp_path, token[1], [standby_port])  # it only knows the standby
    started.append(agent)
    agent.start()
    wait_until(lambda: leader.agents() == 1)
    wait_until(lambda: agent.agent.connected)  # it took the welcome (counted before that)
    assert standby.agents() == 0
    assert agent.agent.leader_epoch == (CLUSTER, 7)
    assert standby.call(lambda: dict(standby.coordinator.live.rejected or {})).get("not_leader")


@pytest.mark.parametrize("knows_leader", [False, True])
def test_an_agent_backs_off_from_standbys_that_know_no_leader(
    tmp_path: Path, token: tuple[bytes, Path], started: list[Any], knows_leader: bool
) -> None:
    """Coordinators that cannot reach etcd all answer "no leader elected yet": a round of them
    asks for a pause (the uplink then backs off to one round a second), not the plain 100 ms
    retry, which made every agent handshake with every standby about ten times a second for
    as long as etcd was away. Standbys that name a leader which did not answer (it died, a
    takeover under way) still get the plain retry: its knocks make a standby depose it."""
    with closed_port() as dead:
        redirect = f"leader=127.0.0.1:{dead} epoch=7" if knows_leader else None
        ports = []
        for _ in range(2):
            standby = CoordinatorThread(token[0], SetLeadership(None, redirect))
            started.append(standby)
            ports.append(standby.start())
        agent = Agent(_agent_config(tmp_path, token[1], ports))
        link, pause = asyncio.run(agent._connect_leader())
    assert link is None
    assert (pause is None) is knows_leader, pause
    for standby in started:
        assert standby.call(lambda s=standby: dict(s.coordinator.live.rejected or {})).get(
            "not_leader"
        )


def test_a_deposed_leader_is_refused_and_its_stale_levels_dropped(
    tmp_path: Path, token: tuple[bytes, Path], started: list[Any]
) -> None:
    first = SetLeadership(7)
    new = CoordinatorThread(token[0], first)
    started.append(new)
    new_port = new.start()
    deposed_leadership = SetLeadership(5)  # believes it still leads, with an older epoch
    deposed = CoordinatorThread(token[0], deposed_leadership)
    started.append(deposed)
    deposed_port = deposed.start()
    agent = _agent(tmp_path, token[1], [new_port, deposed_port])
    started.append(agent)
    agent.start()
    wait_until(lambda: new.agents() == 1)
    wait_until(lambda: agent.agent.connected)  # it took the welcome (counted before that)
    assert agent.agent.leader_epoch == (CLUSTER, 7)

    # the epoch-7 leader goes away: the only coordinator left leads with epoch 5
    new.stop()
    wait_until(lambda: agent.agent.stats["deposed_refused"] >= 2)
    # the agent keeps retrying, and each try is attached on the coordinator's side from its
    # welcome until the agent's refusal closes it: it must keep ending, never stay
    refusals = agent.agent.stats["deposed_refused"]
    wait_until(lambda: agent.agent.stats["deposed_refused"] > refusals)
    wait_until(lambda: deposed.agents() == 0)
    assert agent.agent.leader_epoch == (CLUSTER, 7), "the agent followed a deposed leader"

    # re-elected with a newer epoch, the same coordinator is followed again
    deposed_leadership.leadership = Leadership(9, CLUSTER, 2)
    wait_until(lambda: deposed.agents() == 1)
    # followed: a try still refused (its welcome said epoch 5) is counted until it closes
    wait_until(lambda: agent.agent.connected)
    assert agent.agent.leader_epoch == (CLUSTER, 9)

    # a flow makes it send levels; stamped below what the agent followed, they are dropped
    # and the session ends (a coordinator whose frames claim an older leadership)
    table = FlowTable.open(str(tmp_path / "table"), writable=True)
    try:
        refused = agent.agent.stats["deposed_refused"]
        deposed_leadership.leadership = Leadership(8, CLUSTER, 2)
        slot = EmulatedPluginSlot(table, class_id=int(FlowClass.KV))
        slot.send(1 << 20)
        wait_until(lambda: agent.agent.stats["deposed_refused"] > refused)
    finally:
        table.close()


def test_epochs_of_another_etcd_cluster_are_not_compared(
    tmp_path: Path, token: tuple[bytes, Path], started: list[Any]
) -> None:
    # a coordinator without etcd (epoch 0, cluster 0) after an elected one: followed
    plain = CoordinatorThread(token[0], SetLeadership(None))
    plain.coordinator.candidacy = None
    started.append(plain)
    port = plain.start()
    agent = _agent(tmp_path, token[1], [port])
    agent.agent.leader_epoch = (CLUSTER, 50)
    started.append(agent)
    agent.start()
    wait_until(lambda: plain.agents() == 1)
    wait_until(lambda: agent.agent.connected)  # it took the welcome (counted before that)
    assert agent.agent.leader_epoch == (0, 0)
