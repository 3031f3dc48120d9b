"""free_ports: distinct ports, outside the kernel's ephemeral range where it leaves room;
closed_port: a port that refuses connections and cannot be taken while held."""

from __future__ import annotations

import socket
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
