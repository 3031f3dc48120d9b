"""The agent's cache of coordinator names (flowsched.agent.resolver): a name is resolved at
most once a second while the agent reconnects every 0.1 s, a failure too; an address that
timed out is forgotten. And end to end: an agent retrying a coordinator that is away."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
from agent_helpers import agent_config, wait_until

from flowsched.agent.resolver import NAME_TTL, NameCache, is_address, resolve_stream
from flowsched.agent.threaded import AgentThread
from flowsched.protocol import write_token
from flowsched.testbed.daemons import closed_port


class FakeResolver:
    """Answers from ``table`` (an address list, or an OSError to raise), counting the calls."""

    def __init__(self, table: dict[str, list[str] | OSError]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        answer = self.table[host]
        if isinstance(answer, OSError):
            raise answer
        return answer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _cache(table: dict[str, list[str] | OSError]) -> tuple[NameCache, FakeResolver, FakeClock]:
    resolver, clock = FakeResolver(table), FakeClock()
    return NameCache(resolver, ttl=1.0, clock=clock), resolver, clock


def _lookup(cache: NameCache, host: str) -> list[str] | str:
    """The addresses, or the error's type and text."""
    try:
        return asyncio.run(cache.addresses(host, 7711))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


NXDOMAIN = socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.mark.parametrize(
    ("host", "times", "answers", "resolved"),
    [
        # within the TTL one resolution serves every try; after it, a new one
        ("coord", [0.0, 0.1, 0.9], [["10.0.0.5"]] * 3, 1),
        ("coord", [0.0, 0.5, 1.0, 1.5, 2.0], [["10.0.0.5"]] * 5, 3),
        # a failure is kept as long, each try raising it afresh
        ("gone", [0.0, 0.1, 0.2], ["gaierror: [Errno -2] Name or service not known"] * 3, 1),
        # addresses are never resolved
        ("10.1.2.3", [0.0, 0.1], [["10.1.2.3"]] * 2, 0),
        ("fd00::7", [0.0], [["fd00::7"]], 0),
    ],
    ids=["within-ttl", "after-ttl", "failure-kept", "ipv4-literal", "ipv6-literal"],
)
def test_a_name_is_resolved_once_per_ttl(
    host: str, times: list[float], answers: list[list[str] | str], resolved: int
) -> None:
    cache, resolver, clock = _cache({"coord": ["10.0.0.5"], "gone": NXDOMAIN})
    seen = []
    for offset in times:
        clock.now = 100.0 + offset
        seen.append(_lookup(cache, host))
    assert seen == answers
    assert len(resolver.calls) == resolved


def test_a_forgotten_name_is_resolved_again_at_once() -> None:
    cache, resolver, _ = _cache({"coord": ["10.0.0.5"]})
    assert _lookup(cache, "coord") == ["10.0.0.5"]
    resolver.table["coord"] = ["10.0.0.9"]  # the pod was re-created
    assert _lookup(cache, "coord") == ["10.0.0.5"]
    cache.forget("coord", 7711)
    assert _lookup(cache, "coord") == ["10.0.0.9"]


def test_expired_answers_are_dropped_as_others_come_in() -> None:
    """Names a coordinator redirected to are cached too: they must not pile up."""
    cache, _, clock = _cache({f"r{i}": [f"10.0.0.{i}"] for i in range(50)})
    for i in range(50):
        clock.now += 0.5
        _lookup(cache, f"r{i}")
        assert len(cache._answers) <= 2


@pytest.mark.parametrize(
    ("host", "expected"),
    [("10.0.0.1", True), ("::1", True), ("fe80::1%2", True), ("coord", False), ("", False)],
)
def test_is_address(host: str, expected: bool) -> None:
    assert is_address(host) is expected


def test_resolve_stream_resolves_localhost() -> None:
    found = asyncio.run(resolve_stream("localhost", 7711))
    assert "127.0.0.1" in found or "::1" in found
    assert len(found) == len(set(found))


def test_an_agent_retrying_an_absent_coordinator_resolves_its_name_once_a_second(
    tmp_path: Path,
) -> None:
    """Nothing listens at the coordinator's address: the agent retries every 0.02 s here
    (0.1 s by default), and resolved the name at each try, up to six DNS queries each under
    Kubernetes' search list: ~60 a second from every node while the coordinator was away."""
    token = tmp_path / "token"
    write_token(token)
    with closed_port() as port:
        config = agent_config(
            tmp_path,
            coordinator=("localhost", port),
            token_file=str(token),
            metrics_port=None,
            reconnect_interval=0.02,
            fallback_after=30.0,
        )
        running = AgentThread(config)
        resolved: list[float] = []

        async def counted(host: str, port: int) -> list[str]:
            resolved.append(time.monotonic())
            return await resolve_stream(host, port)

        running.agent._names = NameCache(counted)
        with running:
            started = time.monotonic()
            wait_until(lambda: running.agent.stats["connects_failed"] >= 80, timeout=30)
            elapsed = time.monotonic() - started
            tries = running.agent.stats["connects_failed"]
    assert resolved, "the name was never resolved"
    assert elapsed > NAME_TTL  # (80 tries at 0.02 s at least)
    assert tries >= 10 * len(resolved)
    assert len(resolved) <= elapsed / NAME_TTL + 2, (
        f"{len(resolved)} resolutions in {elapsed:.2f} s"
    )
