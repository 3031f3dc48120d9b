"""What the uplink says while it cannot connect, and how it spaces its attempts (issue 10)."""

from __future__ import annotations

import logging
import math
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import wait_until
from test_agent_uplink import CoordinatorThread

from flowsched.agent import AgentConfig, service
from flowsched.agent.service import RECONNECT_JITTER, Agent
from flowsched.agent.threaded import AgentThread
from flowsched.protocol import Error, encode_frame, write_token
from flowsched.testbed.daemons import closed_port


def test_jitter_spreads_pauses_around_their_value() -> None:
    agent = Agent.__new__(Agent)
    agent._rng = random.Random(7)
    pauses = [agent.jittered(1.0) for _ in range(2000)]
    assert min(pauses) >= 1.0 - RECONNECT_JITTER and max(pauses) <= 1.0 + RECONNECT_JITTER
    assert abs(sum(pauses) / len(pauses) - 1.0) < 0.03
    assert max(pauses) - min(pauses) > RECONNECT_JITTER  # really spread


def _agent(tmp_path: Path, port: int, token_file: Path) -> AgentThread:
    return AgentThread(
        AgentConfig(
            node="n1",
            socket_path=str(tmp_path / "flowsched" / "agent.sock"),
            table_path=str(tmp_path / "flowsched" / "table"),
            coordinator=("127.0.0.1", port),
            token_file=str(token_file),
            num_slots=8,
            metrics_port=None,
            interfaces=("lo",),
            reconnect_interval=0.02,
            fallback_after=30.0,
        )
    )


def _allowed_messages(elapsed: float) -> int:
    # the first at once, then after 1 s, 2 s, 4 s ...: 1 + floor(log2(1 + elapsed)) at most
    return 1 + int(math.log2(1.0 + elapsed))


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Every jittered pause the uplink takes."""
    taken: list[float] = []
    real = Agent.jittered

    def recording(self: Agent, pause: float) -> float:
        taken.append(real(self, pause))
        return taken[-1]

    monkeypatch.setattr(Agent, "jittered", recording)
    yield taken


def test_a_refused_connection_is_logged_as_such_and_less_and_less(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pauses: list[float]
) -> None:
    caplog.set_level(logging.INFO, logger="flowsched.agent")
    token_file = tmp_path / "token"
    write_token(token_file)
    started = time.monotonic()
    with closed_port() as port, _agent(tmp_path, port, token_file) as running:
        wait_until(lambda: running.agent.stats["connects_failed"] >= 15)
        elapsed = time.monotonic() - started
    said = [r for r in caplog.records if "refused the connection" in r.getMessage()]
    assert said and "(nothing listens there)" in said[0].getMessage()
    assert len(said) <= _allowed_messages(elapsed) < 15
    assert all(0.02 * (1 - RECONNECT_JITTER) <= p <= 0.02 * (1 + RECONNECT_JITTER) for p in pauses)
    assert len({round(p, 6) for p in pauses}) > 1, "reconnect pauses are not jittered"


def test_a_repeating_auth_failure_is_logged_once_then_less_and_less(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "REFUSED_PAUSE", 0.02)  # many refusals in little time
    monkeypatch.setattr(service, "MAX_RECONNECT_BACKOFF", 0.05)
    caplog.set_level(logging.INFO, logger="flowsched.agent")
    coordinator = CoordinatorThread(write_token(tmp_path / "coordinator-token"))
    port = coordinator.start()
    try:
        write_token(tmp_path / "wrong-token")
        started = time.monotonic()
        with _agent(tmp_path, port, tmp_path / "wrong-token") as running:
            wait_until(lambda: running.agent.stats["handshakes_refused"] >= 10)
            elapsed = time.monotonic() - started
    finally:
        coordinator.stop()
    said = [r for r in caplog.records if "refused us" in r.getMessage()]
    assert said and "auth_failed" in said[0].getMessage()
    assert len(said) <= _allowed_messages(elapsed) < 10


class _TokenlessListener:
    """What listens at the coordinator's address without the token (a local user while the
    coordinator restarts, a stale address): it answers each hello with an ``error`` frame of
    its own text, a new code every time, with a line break and 4,000 characters of reason."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.refusals = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(4096)  # the hello
                    code = f"no_{self.refusals}\nflowsched.agent ERROR forged line"
                    conn.sendall(encode_frame(Error(code, "x" * 4000 + "\nforged too")))
                    self.refusals += 1
                    while conn.recv(4096):  # until the agent closes
                        pass
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()


def test_what_a_tokenless_listener_says_is_logged_escaped_cut_and_less_and_less(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its text reached the log as it came (a line break forges a line, and 4 KB a refusal),
    and each new code was a new key of the falling rate, so every refusal was logged."""
    monkeypatch.setattr(service, "REFUSED_PAUSE", 0.02)  # many refusals in little time
    monkeypatch.setattr(service, "MAX_RECONNECT_BACKOFF", 0.05)
    caplog.set_level(logging.INFO, logger="flowsched.agent")
    rogue = _TokenlessListener()
    try:
        write_token(tmp_path / "token")
        started = time.monotonic()
        with _agent(tmp_path, rogue.port, tmp_path / "token") as running:
            wait_until(lambda: running.agent.stats["handshakes_refused"] >= 10)
            elapsed = time.monotonic() - started
    finally:
        rogue.close()
    said = [r.getMessage() for r in caplog.records if "refused us" in r.getMessage()]
    assert said and all("\n" not in line and len(line) < 600 for line in said), said[:1]
    assert "no_0\\n" in said[0]  # escaped, still readable
    assert len(said) <= _allowed_messages(elapsed) < 10
