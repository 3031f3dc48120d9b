"""The agent's coordinator link against an in-process coordinator: reconnects, backoff, faults."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import wait_until
from prometheus_client import CollectorRegistry

from flowsched import client
from flowsched.agent import AgentConfig
from flowsched.agent.service import Agent
from flowsched.agent.threaded import AgentThread
from flowsched.coordinator import Coordinator, CoordinatorConfig
from flowsched.coordinator.connection import AgentConnection
from flowsched.model import FlowClass
from flowsched.protocol import RESYNC_FRAME_OPENS, Heartbeat, write_token


class CoordinatorThread:
    """A coordinator on its own event loop in a daemon thread (agents run on theirs)."""

    def __init__(self, token: bytes) -> None:
        config = CoordinatorConfig.from_policy_file(None, token, metrics_port=None)
        self.coordinator = Coordinator(config, registry=CollectorRegistry())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> int:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self.coordinator.start(), self._loop)
        return future.result(10).port

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the coordinator's loop (its state changes only there)."""

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.coordinator.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[CoordinatorThread, int, Path]]:
    token_file = tmp_path / "token"
    running = CoordinatorThread(write_token(token_file))
    port = running.start()
    try:
        yield running, port, token_file
    finally:
        running.stop()


def _agent(tmp_path: Path, port: int, token_file: Path, name: str, **overrides: Any) -> AgentThread:
    settings: dict[str, Any] = dict(
        node="n1",
        socket_path=str(tmp_path / f"{name}.sock"),
        table_path=str(tmp_path / f"{name}.table"),
        coordinator=("127.0.0.1", port),
        token_file=str(token_file),
        num_slots=16,
        metrics_port=None,
        interfaces=("lo",),
        fallback_after=5.0,
    )
    settings.update(overrides)
    return AgentThread(AgentConfig(**settings))


def test_a_failing_session_does_not_end_the_uplink(
    coordinator: tuple[CoordinatorThread, int, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, port, token_file = coordinator
    real_session = Agent._session
    calls: list[int] = []

    async def fail_once(self: Agent, link: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OverflowError("Integer value out of range")  # what msgpack raised
        await real_session(self, link)

    monkeypatch.setattr(Agent, "_session", fail_once)
    with _agent(tmp_path, port, token_file, "a") as agent:
        wait_until(lambda: agent.agent.connected)
        assert len(calls) >= 2


def test_agents_with_the_same_node_back_off_and_say_why(
    coordinator: tuple[CoordinatorThread, int, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, port, token_file = coordinator
    caplog.set_level(logging.WARNING)
    with (
        _agent(tmp_path, port, token_file, "a") as first,
        _agent(tmp_path, port, token_file, "b") as second,
    ):
        time.sleep(2.0)
        connects = [first.agent.stats["connects"], second.agent.stats["connects"]]
    # without a pause between sessions each made hundreds of connections per second
    assert max(connects) <= 12, connects
    assert "another agent uses --node n1" in caplog.text
    assert "two agents use the same --node name" in caplog.text


def test_the_local_policy_starts_while_the_coordinator_keeps_ending_sessions(
    coordinator: tuple[CoordinatorThread, int, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, port, token_file = coordinator

    def end_at_once(self: Coordinator, connection: AgentConnection) -> None:
        connection.abort("refused", "test: every session ends after the handshake")

    monkeypatch.setattr(Coordinator, "attach", end_at_once)
    with _agent(tmp_path, port, token_file, "a", fallback_after=0.5) as agent:
        wait_until(lambda: agent.agent.fallback is not None, timeout=3.0)
        before = agent.agent.stats["connects"]
        wait_until(lambda: agent.agent.stats["connects"] >= before + 2, timeout=5.0)
        # the sessions that ended after their handshake did not stop the local policy
        assert agent.agent.fallback is not None
        assert agent.agent.stats["fallback_switches"] == 1
        connects = agent.agent.stats["connects"]
    assert connects <= 15, connects


def test_a_reporting_agent_sends_no_heartbeats_an_idle_one_does(
    coordinator: tuple[CoordinatorThread, int, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any frame tells the coordinator the agent is alive: while a flow's progress goes out
    every 0.1 s (the progress interval) no heartbeat (every 0.2 s) is sent; once the agent
    has nothing to report, heartbeats come again."""
    _, port, token_file = coordinator
    beats: list[float] = []
    handle = Coordinator.handle

    def counting(self: Coordinator, node: str, message: Any, arrival: float) -> None:
        if isinstance(message, Heartbeat):
            beats.append(time.monotonic())
        handle(self, node, message, arrival)

    monkeypatch.setattr(Coordinator, "handle", counting)
    with _agent(tmp_path, port, token_file, "a") as agent:
        wait_until(lambda: agent.agent.connected)
        opened = agent.agent.stats["batches_sent"]
        handle_flow = client.open_flow("bulk", socket_path=agent.agent.config.socket_path)
        try:
            wait_until(lambda: agent.agent.stats["batches_sent"] > opened)  # the open
            reporting_since, batches = time.monotonic(), agent.agent.stats["batches_sent"]
            while time.monotonic() - reporting_since < 1.5:
                handle_flow.add_bytes(1 << 20)
                time.sleep(0.02)
            busy = [t for t in beats if t >= reporting_since]
            assert agent.agent.stats["batches_sent"] - batches >= 10
            assert len(busy) <= 1, busy  # (one may fall in the pause before the first report)
        finally:
            handle_flow.close()
        idle_since = time.monotonic() + 0.5  # the close and its last progress go out first
        wait_until(lambda: len([t for t in beats if t >= idle_since]) >= 3, timeout=5.0)


def test_an_agent_with_more_flows_than_one_frame_holds_keeps_them_across_a_reconnect(
    coordinator: tuple[CoordinatorThread, int, Path], tmp_path: Path
) -> None:
    """A real agent's resync of more flows than one frame holds (NCCL opens many
    connections): the coordinator admitted the flows after the first frame as new ones (new
    ids; strikes, rates and policy state reset). They now keep their place in its table."""
    running, port, token_file = coordinator
    node_flows = RESYNC_FRAME_OPENS + 30
    state = running.coordinator.state

    def table() -> dict[int, int]:
        return dict(state.by_node.get("n1", {}))

    def opens_taken() -> int:  # the first report's, then the resync's (either kind)
        return state.stats.events["open"] + state.stats.events["resync_flow"]

    with _agent(tmp_path, port, token_file, "a") as agent:
        wait_until(lambda: agent.agent.connected)
        registry = agent.agent.registry
        assert registry is not None
        agent.run(
            lambda: [registry.open_sdk(1, FlowClass.BULK, time.time()) for _ in range(node_flows)]
        )
        wait_until(lambda: len(running.run(table)) == node_flows, timeout=5.0)
        before = running.run(table)
        running.run(lambda: running.coordinator.sessions["n1"].abort("refused", "test: cut"))
        wait_until(lambda: agent.agent.stats["resyncs_sent"] >= 2, timeout=5.0)
        wait_until(lambda: running.run(opens_taken) >= 2 * node_flows, timeout=5.0)
        assert running.run(table) == before


def test_nic_loop_survives_a_failing_sample(tmp_path: Path) -> None:
    config = AgentConfig(
        node="n1",
        socket_path=str(tmp_path / "a.sock"),
        table_path=str(tmp_path / "table"),
        num_slots=16,
        metrics_port=None,
        interfaces=("lo",),
        nic_interval=0.02,
    )
    with AgentThread(config) as running:
        agent = running.agent
        real_sample = agent.nic.sample
        failures: list[int] = []

        def sample_failing_twice() -> Any:
            if len(failures) < 2:
                failures.append(1)
                raise ZeroDivisionError("float division by zero")
            return real_sample()

        def install() -> None:
            agent.nic.sample = sample_failing_twice  # type: ignore[method-assign]
            agent._pending_nic = None

        running.run(install)
        wait_until(lambda: len(failures) == 2 and agent._pending_nic is not None)
