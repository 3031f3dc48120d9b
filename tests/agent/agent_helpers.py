"""TEST SUPPORT for the agent tests."""

from __future__ import annotations

import contextlib
import socket
import struct
from pathlib import Path

from polling import wait_until

from flowsched.agent import AgentConfig
from flowsched.testbed.sdk_flood import shareable_group

__all__ = ["agent_config", "lingering_tcp_socket", "shareable_group", "wait_until"]


def agent_config(tmp_path: Path, **overrides: object) -> AgentConfig:
    """An in-process agent's config under ``tmp_path`` (socket in run/, 32 slots, metrics on a
    free port, local fallback after 0.2 s on lo); ``overrides`` replace any field."""
    settings: dict[str, object] = dict(
        node="n1",
        socket_path=str(tmp_path / "run" / "agent.sock"),
        table_path=str(tmp_path / "table"),
        num_slots=32,
        metrics_port=0,
        fallback_after=0.2,
        interfaces=("lo",),
    )
    settings.update(overrides)
    return AgentConfig(**settings)  # type: ignore[arg-type]


def lingering_tcp_socket(linger: int) -> tuple[socket.socket, socket.socket]:
    """A TCP socket whose last close blocks for ``linger`` seconds: SO_LINGER set, unsent data,
    and a peer (returned too: keep it open) whose receive window is full. Closing the peer ends
    a close held up at once (the reset wakes it)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.socket()
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sender.connect(listener.getsockname())
        peer, _ = listener.accept()  # never reads
    sender.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            sender.send(b"x" * 65536)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger))
    return sender, peer
