"""free_ports: distinct ports, outside the kernel's ephemeral range where it leaves room;
closed_port: a port that refuses connections and cannot be taken while held."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowsched.testbed import daemons
from flowsched.testbed.daemons import PORT_BAND, closed_port, free_ports


def _ephemeral_low() -> int:
    return int(daemons.EPHEMERAL_RANGE.read_text().split()[0])


def _listen(port: int) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    for _ in range(50):
        ports = free_ports(6)
        assert len(set(ports)) == 6
        assert all(PORT_BAND[0] <= port < min(PORT_BAND[1], _ephemeral_low()) for port in ports)
    for port in ports:
        _listen(port)


@pytest.fixture
def busy() -> Iterator[int]:
    """A port in the band that is held bound (listening) for the test."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_ports(1)[0]))
        server.listen()
        yield server.getsockname()[1]


def test_a_port_in_use_is_passed_over(busy: int, monkeypatch: pytest.MonkeyPatch) -> None:
    others = free_ports(3)  # (free now, and not ``busy``, which is held)
    monkeypatch.setattr(daemons.random, "sample", lambda band, k: [busy, *others])
    ports = free_ports(3)
    assert busy not in ports and ports == others[:3]


@pytest.mark.parametrize(
    ("range_text", "expect_band"),
    [
        ("1024\t65535\n", False),  # no room below the range: the kernel picks
        ("9000 65535\n", False),
        ("15000 60999\n", True),  # the band, cut at 15000
        (None, True),  # unreadable: the whole band
    ],
)
def test_where_the_ports_come_from(
    range_text: str | None, expect_band: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ip_local_port_range"
    if range_text is not None:
        path.write_text(range_text)
    monkeypatch.setattr(daemons, "EPHEMERAL_RANGE", path)
    ports = free_ports(4)
    assert len(set(ports)) == 4
    high = int(range_text.split()[0]) if range_text is not None else PORT_BAND[1]
    in_band = [PORT_BAND[0] <= port < min(high, PORT_BAND[1]) for port in ports]
    assert all(in_band) if expect_band else not any(in_band)
    for port in ports:
        _listen(port)


def test_a_closed_port_refuses_connections_and_cannot_be_taken_while_held() -> None:
    with closed_port() as port:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
            with pytest.raises(OSError, match="in use"):
                server.bind(("127.0.0.1", port))
    _listen(port)  # free again once the block ends


#: a wrapper that never execs the daemon and never prints: a daemon that does not get ready
_SILENT = ("sh", "-c", "exec sleep 60", "sh")


def _started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[str]]:
    """The processes :func:`daemons.spawn` starts from now on."""
    started: list[subprocess.Popen[str]] = []
    popen = subprocess.Popen

    def record(*args: object, **kwargs: object) -> subprocess.Popen[str]:
        proc = popen(*args, **kwargs)  # type: ignore[call-overload]
        started.append(proc)
        return proc  # type: ignore[no-any-return]

    monkeypatch.setattr(daemons.subprocess, "Popen", record)
    return started


def test_a_daemon_that_never_gets_ready_is_killed_and_reaped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started = _started(monkeypatch)
    try:
        with pytest.raises(AssertionError, match="did not become ready"):
            daemons.spawn("silent", [], tmp_path / "log", "ready", timeout=0.3, wrapper=_SILENT)
        assert len(started) == 1
        assert started[0].returncode is not None, "killed but left a zombie"
        assert started[0].stdout is not None and started[0].stdout.closed
    finally:
        for proc in started:
            daemons.reap(proc)


def test_an_interrupted_wait_for_the_ready_line_kills_the_daemon(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ctrl-C while spawn waits: the process it started must not outlive it."""
    started = _started(monkeypatch)

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(daemons.select, "select", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            daemons.spawn("silent", [], tmp_path / "log", "ready", timeout=30, wrapper=_SILENT)
        assert len(started) == 1
        assert started[0].returncode is not None, "the daemon was left running"
    finally:
        for proc in started:
            daemons.reap(proc)
