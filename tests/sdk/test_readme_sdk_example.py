"""The README's SDK example, run as a user would: its socket carries the flow's marking, on
IPv4 and IPv6, and follows a promotion while the bytes are sent."""

from __future__ import annotations

import contextlib
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from polling import wait_until

from flowsched import client
from flowsched.agent.threaded import AgentThread

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_example() -> str:
    """The python block after 'Applications say what NCCL cannot', its ``...`` (where the
    application sends) replaced by a call of ``sending(f, sock)``."""
    text = README.read_text()
    start = text.index("Applications say what NCCL cannot")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block is not None, "the README's SDK example is gone"
    code, found = re.subn(r"(?m)^(\s+)\.\.\.(\s*#.*)?$", r"\1sending(f, sock)", block.group(1))
    assert found == 1, "the example no longer has one '...' where it sends"
    return code


def _traffic_class(sock: socket.socket) -> int:
    """The TOS byte the kernel puts on the socket's packets."""
    if sock.family == socket.AF_INET6:
        return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS)
    return sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def test_the_readme_sdk_example_marks_its_socket_and_follows_a_promotion(
    host: str, agent: AgentThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((host, 0))
    except OSError as exc:
        pytest.skip(f"no {host} here: {exc}")
    monkeypatch.setenv("FLOWSCHED_SOCKET", agent.ready.socket)  # type: ignore[union-attr]
    real_connect = socket.create_connection
    monkeypatch.setattr(
        socket, "create_connection", lambda _address, *a, **kw: real_connect(
            listener.getsockname()[:2], *a, **kw
        )
    )  # fmt: skip
    seen: list[tuple[int, int]] = []

    def sending(f: client.FlowHandle, sock: socket.socket) -> None:
        assert f.connected
        seen.append((_traffic_class(sock), f.tos))
        target = 0 if f.level != 0 else 1
        agent.run(lambda: agent.agent.apply_levels([(f.id, target)]))
        wait_until(lambda: f.level == target)
        with contextlib.suppress(AssertionError):  # the comparison below says what it is
            wait_until(lambda: _traffic_class(sock) == f.tos, 3.0)  # set by the SDK's thread
        seen.append((_traffic_class(sock), f.tos))

    with listener:
        listener.listen()
        scope: dict[str, Any] = {"sending": sending}
        exec(compile(_readme_example(), str(README), "exec"), scope)
        scope["sock"].close()
    assert len(seen) == 2 and seen[0][1] != seen[1][1]
    # the socket's TOS byte before and after the promotion == the flow's tos then
    assert [tos for tos, _ in seen] == [want for _, want in seen]
