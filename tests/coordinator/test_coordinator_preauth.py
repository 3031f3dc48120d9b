"""Unauthenticated peers in-process: one handshake deadline, connection caps, the fd limit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import AsyncIterator

import pytest
from coordinator_helpers import TOKEN, connect_as, running_coordinator, wait_until

from flowsched.coordinator import Coordinator, reach, service
from flowsched.coordinator.service import FD_RESERVE, METRICS_MAX_CONNECTIONS
from flowsched.fdlimit import raise_fd_limit
from flowsched.protocol import Connection, Heartbeat, Role

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def _raw_connections(coordinator: Coordinator, count: int) -> AsyncIterator[list[Stream]]:
    assert coordinator.addresses is not None
    host, port = coordinator.addresses.host, coordinator.addresses.port
    streams = [await asyncio.open_connection(host, port) for _ in range(count)]
    try:
        yield streams
    finally:
        for _, writer in streams:
            writer.close()


async def _closed_by_peer(reader: asyncio.StreamReader, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass


@pytest.mark.asyncio
async def test_a_byte_dripping_peer_is_cut_at_the_handshake_deadline() -> None:
    hello = Connection(Role.AGENT, token=TOKEN).hello("drip")
    async with (
        running_coordinator(handshake_timeout=0.6) as coordinator,
        _raw_connections(coordinator, 1) as [(reader, writer)],
    ):
        started = time.monotonic()
        closed = asyncio.ensure_future(_closed_by_peer(reader, 5.0))
        for byte in hello * 100:  # far longer than the deadline at one byte per 50 ms
            if closed.done():
                break
            writer.write(bytes([byte]))
            await asyncio.wait({closed}, timeout=0.05)
        await closed
        elapsed = time.monotonic() - started
    # each byte arrives well within any per-read timeout: only a whole-handshake deadline cuts it
    assert 0.55 <= elapsed < 1.5, elapsed
    assert coordinator.live.rejected == {"timeout": 1}
    assert coordinator.turned_away_lately() == 1  # it reached us and was not served


@pytest.mark.asyncio
async def test_unauthenticated_connections_are_capped_and_agents_still_get_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="flowsched.coordinator")
    async with running_coordinator(max_unauthenticated=8, handshake_timeout=30) as coordinator:
        first = await connect_as(coordinator, "first")
        async with _raw_connections(coordinator, 40) as idle:
            await wait_until(
                lambda: coordinator.live.rejected.get("evicted", 0) >= 32, 5, "evictions"
            )
            assert coordinator.unauthenticated_count <= 8
            assert coordinator.turned_away_lately() >= 32
            late = await connect_as(coordinator, "late")  # evicts the oldest idle peer
            await first.send(Heartbeat(1.0))
            assert coordinator.agent_count() == 2
            for reader, _ in idle[:32]:  # the oldest were closed for the newer ones
                await _closed_by_peer(reader, 2.0)
        await late.close()
        await first.close()
    assert "unauthenticated connections at their cap (8 of 8" in caplog.text


@pytest.mark.asyncio
async def test_established_agents_filling_the_budget_refuse_new_connections() -> None:
    async with running_coordinator(max_connections=3) as coordinator:
        coordinator.max_connections = 3  # what the fd budget would leave
        links = [await connect_as(coordinator, f"n{i}") for i in range(3)]
        try:
            async with _raw_connections(coordinator, 1) as [(reader, _)]:
                await _closed_by_peer(reader, 2.0)
            assert coordinator.live.rejected["too_many_connections"] == 1
            assert coordinator.agent_count() == 3
            # what it publishes while leading: a standby must not take agents turned away
            # here for agents that cannot reach it (flowsched.coordinator.reach)
            assert coordinator.turned_away_lately() == 1
        finally:
            for link in links:
                await link.close()


def test_the_fd_soft_limit_is_raised_to_the_hard_limit_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 600:
        pytest.skip(f"needs a finite hard open-file limit above 600 (have {hard})")
    caplog.set_level(logging.INFO, logger="flowsched.coordinator")
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
    try:
        assert raise_fd_limit(logging.getLogger("flowsched.coordinator")) == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert f"open-file limit raised from 512 to {hard} (the hard limit)" in caplog.text


@pytest.mark.parametrize(
    ("fd_limit", "configured", "expected_total", "expected_unauthenticated"),
    [
        (1024, (16384, 2048), 1024 - FD_RESERVE - METRICS_MAX_CONNECTIONS, 928),
        (1 << 20, (16384, 2048), 16384, 2048),
        (200, (16384, 2048), 200 - FD_RESERVE - METRICS_MAX_CONNECTIONS, 104),
        (1 << 20, (100, 500), 100, 100),
    ],
)
def test_connection_caps_leave_the_metrics_listener_its_descriptors(
    fd_limit: int,
    configured: tuple[int, int],
    expected_total: int,
    expected_unauthenticated: int,
) -> None:
    from coordinator_helpers import BytesPolicy

    from flowsched.coordinator import CoordinatorConfig

    config = CoordinatorConfig(
        token=TOKEN,
        policy_factory=BytesPolicy,
        max_connections=configured[0],
        max_unauthenticated=configured[1],
    )
    coordinator = Coordinator(config)
    coordinator._size_connection_caps(fd_limit)
    assert coordinator.max_connections == expected_total
    assert coordinator.max_unauthenticated == expected_unauthenticated
    assert fd_limit - coordinator.max_connections >= min(
        FD_RESERVE + METRICS_MAX_CONNECTIONS, fd_limit
    )


class _FakeSession:
    def __init__(self, peer: str, closed: bool) -> None:
        self.node, self.peer, self.peer_closed = "n1", peer, closed
        self.aborted: str | None = None

    def abort(self, code: str, reason: str, *, tell_peer: bool = False) -> None:
        self.aborted = code


@pytest.mark.parametrize(("old_closed", "warned"), [(True, False), (False, True)])
def test_a_reconnect_is_not_mistaken_for_two_agents_with_one_name(
    old_closed: bool, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from coordinator_helpers import BytesPolicy

    from flowsched.coordinator import CoordinatorConfig

    caplog.set_level(logging.INFO, logger="flowsched.coordinator")
    coordinator = Coordinator(CoordinatorConfig(token=TOKEN, policy_factory=BytesPolicy))
    old, new = _FakeSession("10.0.0.1:1000", old_closed), _FakeSession("10.0.0.1:1001", False)
    coordinator.sessions["n1"] = old  # type: ignore[assignment]
    coordinator.attach(new)  # type: ignore[arg-type]
    assert old.aborted == "replaced" and coordinator.sessions["n1"] is new
    assert ("two agents use the same --node name" in caplog.text) is warned
    assert ("agent n1 reconnected from 10.0.0.1:1001" in caplog.text) is not warned


@pytest.mark.asyncio
async def test_idle_connections_to_the_metrics_port_lock_neither_scrapes_nor_agents_out() -> None:
    from flowsched.coordinator.exposition import MAX_CONNECTIONS

    async with running_coordinator() as coordinator:
        addresses = coordinator.addresses
        assert addresses is not None and addresses.metrics_port is not None
        idle = [
            await asyncio.open_connection(addresses.metrics_host, addresses.metrics_port)
            for _ in range(4 * MAX_CONNECTIONS)
        ]
        try:
            reader, writer = await asyncio.open_connection(
                addresses.metrics_host, addresses.metrics_port
            )
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(3):  # REQUEST_TIMEOUT is 5 s: no waiting for idlers
                response = await reader.read()
            writer.close()
            assert response.startswith(b"HTTP/1.1 200 OK")
            assert b"flowsched_coordinator_agents_connected" in response
            link = await connect_as(coordinator, "n1")  # the agents' listener is untouched
            assert coordinator.agent_count() == 1
            await link.close()
            closed = 0
            for idle_reader, _ in idle:  # most idlers were closed to make room
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.01):
                        closed += await idle_reader.read() == b""
            assert closed >= 3 * MAX_CONNECTIONS
        finally:
            for _, idle_writer in idle:
                idle_writer.close()


@pytest.mark.asyncio
async def test_connections_turned_away_are_forgotten_after_the_knock_gap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a leader publishes as turned away covers the last KNOCK_GAP seconds only: one
    refusal must not keep it from ever being deposed."""
    async with running_coordinator() as coordinator:
        clock = [1000.0]
        monkeypatch.setattr(service.time, "monotonic", lambda: clock[0])
        coordinator.count_rejection("too_many_connections")
        coordinator.count_rejection("evicted")
        coordinator.count_rejection("timeout", in_handshake=False)  # a session's silence
        coordinator.count_rejection("auth_failed")  # it did not prove the token
        assert coordinator.turned_away_lately() == 2
        clock[0] += reach.KNOCK_GAP - 0.1
        coordinator.count_rejection("evicted")
        coordinator.count_rejection("timeout")  # a handshake not served in time
        assert coordinator.turned_away_lately() == 4
        clock[0] += 0.2
        assert coordinator.turned_away_lately() == 2
        clock[0] += reach.KNOCK_GAP
        assert coordinator.turned_away_lately() == 0
