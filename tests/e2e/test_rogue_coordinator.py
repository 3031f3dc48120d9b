"""A listener without the token at the coordinator's address (audit finding H1): a real agent
refuses it at the handshake and never sends it its flows.

The rogue is what the audit's repro ran: a coordinator end of the sans-IO protocol with no
token, answering every hello and welcoming every agent (at version 5 its welcome carries no
MAC; held at version 2 or 3 it speaks a version that proves nothing or seals nothing, and the
agent does not even answer it). Before protocol version 3 the
agent took that welcome, sent its resync (every flow's job, request, size and deadline) and
applied the levels it got back.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from e2e_helpers import cleanup, start_agent, wait_for

from flowsched import client
from flowsched.protocol import (
    NEED_DATA,
    Auth,
    Connection,
    Hello,
    Message,
    ProtocolError,
    Role,
    Welcome,
)

pytestmark = pytest.mark.usefixtures("fresh_sdk_connections")


class RogueCoordinator:
    """A tokenless coordinator end on 127.0.0.1 (one thread per connection); ``received``
    holds, per connection, the types of the frames the agent sent it, and ``ended`` those of
    the connections the agent has closed."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.received: list[list[str]] = []
        self.ended: list[list[str]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(Role.COORDINATOR, token=None, version=self.version)
        kinds: list[str] = []
        self.received.append(kinds)
        with sock:
            try:
                while data := sock.recv(65536):
                    conn.receive_data(data)
                    while (event := conn.next_event()) is not NEED_DATA:
                        assert isinstance(event, Message)
                        kinds.append(event.TYPE)
                        self._answer(conn, sock, event)
            except (ProtocolError, OSError):
                pass
        self.ended.append(kinds)

    @staticmethod
    def _answer(conn: Connection, sock: socket.socket, event: Message) -> None:
        if isinstance(event, Hello):
            sock.sendall(conn.challenge())
        elif isinstance(event, Auth):  # the agent's MAC is not checked: it has no token
            sock.sendall(conn.send(Welcome("", 0.001, time.time(), 0.2, epoch=2**64 - 1)))

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize(
    ("version", "expected", "said"),
    [
        # its error after the auth is sealed: a listener without the token cannot read it
        pytest.param(5, ["hello", "auth"], "auth_failed: welcome.mac: missing", id="v5-no-mac"),
        pytest.param(3, ["hello", "error"], "unproven_coordinator", id="held-at-v3"),
        pytest.param(2, ["hello", "error"], "unproven_coordinator", id="held-at-v2"),
    ],
)
def test_a_real_agent_refuses_a_coordinator_without_the_token(
    tmp_path: Path, token: Path, version: int, expected: list[str], said: str
) -> None:
    rogue = RogueCoordinator(version)
    log = tmp_path / "agent-n1.log"
    try:
        with cleanup() as started:
            agent = start_agent(tmp_path, token, rogue.port)
            started.append(agent)
            sock = agent.fields["socket"]
            with client.flow("bulk", bytes=10**9, job="secret-job", socket_path=sock):
                wait_for(lambda: f"refused coordinator 127.0.0.1:{rogue.port}: {said}" in (
                    log.read_text()), 10, "the agent to refuse the rogue")  # fmt: skip
                wait_for(lambda: rogue.ended, 10, "the agent to close the refused connection")
    finally:
        rogue.close()
    # everything a refused connection carried, up to its end: no resync, nothing after the error
    assert rogue.ended[0] == expected, rogue.ended
    # a retry may be cut short by the end of the test, never go further
    assert all(kinds == expected[: len(kinds)] for kinds in rogue.received), rogue.received
    assert "connected to the coordinator" not in log.read_text()
