"""Shared helpers of the coordinator tests: a deterministic policy, a running service and an
agent link to it."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from flowsched.coordinator import Coordinator, CoordinatorConfig
from flowsched.model import Context, Decision, Flow
from flowsched.protocol import PROTOCOL_VERSION, Levels, Message
from flowsched.protocol.aio import AgentLink, connect_agent
from flowsched.testbed.daemons import wait_until as wait_until  # (the coordinator tests' import)

TOKEN = b"test-token-0123456789abcdef"


class BytesPolicy:
    """Test policy: level 7 at admission, one level up per 100 bytes sent (never below 0)."""

    name: ClassVar[str] = "bytes"
    num_levels = 8
    per_flow_decisions = True

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.released: list[int] = []
        self.last_ctx: Context | None = None

    def _level(self, flow: Flow) -> int:
        return max(0, 7 - flow.sent // 100)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return Decision(self._level(flow))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        self.last_ctx = ctx
        changes = {}
        for flow in flows:
            self.seen.append(flow.flow_id)
            if self._level(flow) != flow.level:
                changes[flow.flow_id] = Decision(self._level(flow))
        return changes

    def release(self, flow: Flow, ctx: Context) -> None:
        self.released.append(flow.flow_id)


class DeadlineStepPolicy(BytesPolicy):
    """Test policy with promotion timers: level 7, then level 0 from ``lead`` seconds (default
    one) before the deadline."""

    def __init__(self, lead: float = 1.0) -> None:
        super().__init__()
        self.lead = lead

    def _at(self, flow: Flow, now: float) -> int:
        due = flow.deadline is not None and now >= flow.deadline - self.lead
        return 0 if due else 7

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return Decision(self._at(flow, ctx.now))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        changes = {}
        for flow in flows:
            self.seen.append(flow.flow_id)
            if self._at(flow, ctx.now) != flow.level:
                changes[flow.flow_id] = Decision(self._at(flow, ctx.now))
        return changes

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        if flow.deadline is None or flow.level == 0:
            return None
        return flow.deadline - self.lead


@contextlib.asynccontextmanager
async def running_coordinator(**overrides: Any) -> AsyncIterator[Coordinator]:
    """A started in-process coordinator with BytesPolicy and a fresh registry; always stopped."""
    settings: dict[str, Any] = {"token": TOKEN, "policy_factory": BytesPolicy, "timer_period": 0.05}
    settings.update(overrides)
    coordinator = Coordinator(CoordinatorConfig(**settings), registry=CollectorRegistry())
    await coordinator.start()
    try:
        yield coordinator
    finally:
        await coordinator.stop()


async def connect_as(
    coordinator: Coordinator, node: str, token: bytes = TOKEN, version: int = PROTOCOL_VERSION
) -> AgentLink:
    """An authenticated agent link of ``node`` to the running ``coordinator``, offering
    ``version``."""
    assert coordinator.addresses is not None
    return await connect_agent(
        coordinator.addresses.host, coordinator.addresses.port, node=node, token=token, timeout=5,
        version=version,
    )  # fmt: skip


async def next_levels(link: AgentLink, timeout: float = 3.0) -> Levels:
    """The next ``levels`` frame on ``link`` (other messages skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        message: Message = await link.recv(max(deadline - time.monotonic(), 0.01))
        if isinstance(message, Levels):
            return message


async def scrape(coordinator: Coordinator) -> str:
    """The running ``coordinator``'s ``/metrics`` text."""
    addresses = coordinator.addresses
    assert addresses is not None
    url = f"http://{addresses.metrics_host}:{addresses.metrics_port}/metrics"
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
