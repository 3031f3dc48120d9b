"""The SDK client shows the agent its pid namespace: a descriptor of ``/proc/self/ns/pid``
passed with its first frame (SCM_RIGHTS), which lets an agent that may not read the client's
namespace link key its flows as the client's NCCL connections are keyed (flowsched.shm.pidns).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowsched import client
from flowsched.protocol import sdk


def _namespace_descriptors() -> list[str]:
    """This process's open descriptors that name a pid namespace."""
    links = []
    for name in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            continue
    return [link for link in links if link.startswith("pid:[")]


@pytest.fixture
def recording_agent(tmp_path: Path) -> Iterator[tuple[str, list[tuple[str, object]]]]:
    """A unix socket that answers ``open`` and records, per read, the descriptors that came
    with the bytes (as their /proc links) and the messages."""
    path = str(tmp_path / "agent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    seen: list[tuple[str, object]] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            decoder = sdk.SdkDecoder("agent")
            with conn:
                while True:
                    data, fds, _, _ = socket.recv_fds(conn, 65536, 4)
                    for fd in fds:
                        seen.append(("fd", os.readlink(f"/proc/self/fd/{fd}")))
                        os.close(fd)
                    if not data:
                        break
                    decoder.feed(data)
                    while (message := decoder.next_message()) is not None:
                        seen.append(("message", message))
                        if isinstance(message, sdk.Open):
                            conn.sendall(sdk.encode(sdk.Opened(message.ref, 7, 6, 8, 0)))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path, seen
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        for conn in list(client._connections.values()):
            conn.close()
        client._connections.clear()
        thread.join(timeout=10)


def test_the_first_frame_carries_a_descriptor_of_the_clients_pid_namespace(
    recording_agent: tuple[str, list[tuple[str, object]]],
) -> None:
    path, seen = recording_agent
    before = _namespace_descriptors()
    first = client.open_flow("kv", socket_path=path)
    second = client.open_flow("kv", socket_path=path)
    assert first.id == second.id == 7
    first.close()
    second.close()
    client.connection(path).close()
    kinds = [kind for kind, _ in seen]
    assert kinds[:2] == ["fd", "message"] and kinds.count("fd") == 1  # once, with the first
    assert seen[0][1] == os.readlink("/proc/self/ns/pid")
    assert isinstance(seen[1][1], sdk.Open)  # the frame it came with is intact
    assert _namespace_descriptors() == before  # the client closed its copy
