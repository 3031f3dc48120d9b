"""The SDK client against a scripted agent: frames that arrive back to back are never lost."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowsched import client
from flowsched.protocol import sdk


@pytest.fixture
def scripted_agent(tmp_path: Path) -> Iterator[str]:
    """A unix socket that answers every ``open`` with ``opened`` (level 6) and, in the same
    write, a ``level`` push (level 1): what an agent sends when the coordinator decides
    right after the flow was opened."""
    path = str(tmp_path / "agent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        decoder = sdk.SdkDecoder("agent")
        with conn:
            while data := conn.recv(65536):
                decoder.feed(data)
                while (message := decoder.next_message()) is not None:
                    if isinstance(message, sdk.Open):
                        conn.sendall(
                            sdk.encode(sdk.Opened(message.ref, 42, 6, 8, 0))
                            + sdk.encode(sdk.Level(42, 1, 34, 5))
                        )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        server.close()
        for conn in list(client._connections.values()):
            conn.close()
        client._connections.clear()


@pytest.mark.parametrize("attempt", range(20))  # the race it guards against was a thread race
def test_a_level_pushed_right_after_opened_is_kept(scripted_agent: str, attempt: int) -> None:
    handle = client.open_flow("kv", deadline=1e9, socket_path=scripted_agent)
    try:
        assert handle.id == 42
        deadline = time.monotonic() + 2.0  # the push is read after opened: wait for it
        while handle.level != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert (handle.level, handle.dscp, handle.so_priority) == (1, 34, 5)
    finally:
        handle.close()
        client.connection(scripted_agent).close()
        client._connections.clear()
