"""Levels into slots and SDK answers: the coordinator's decisions reach the table, and only the
right slot; an SDK open gets its first level at once from the agent's copy of the policy (or,
with ``first_level_wait``, from the coordinator).

The tests are in-process and take about a second each: the path coordinator level -> agent ->
table slot was covered only by the slow subprocess e2e tests, and a ``write_slot`` that ignored
``claim_seq`` passed every test.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
from agent_helpers import wait_until
from prometheus_client import CollectorRegistry

from flowsched import policyfile
from flowsched.agent import AgentConfig
from flowsched.agent.service import Agent
from flowsched.agent.threaded import AgentThread
from flowsched.coordinator import Coordinator, CoordinatorConfig
from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.protocol import (
    PROTOCOL_VERSION,
    Flows,
    Heartbeat,
    Resync,
    Welcome,
    sdk,
    write_token,
)
from flowsched.protocol.aio import LinkClosed
from flowsched.shm import layout
from flowsched.shm.table import EmulatedPluginSlot, FlowTable

FIRST_LEVEL, PROMOTED_LEVEL = 5, 2
#: the level the embedded default policy (rmlq) admits 1 GB due in 60 s at: the last deferred
LOCAL_KV_LEVEL = 6
LEVELLED = sdk.Level | sdk.Opened


class ProgressPolicy:
    """Level 5 at admission; level 2 once a flow has sent 1,000 bytes."""

    name: ClassVar[str] = "progress"
    num_levels = 8
    per_flow_decisions = True

    def _level(self, flow: Flow) -> int:
        return PROMOTED_LEVEL if flow.sent >= 1000 else FIRST_LEVEL

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return Decision(self._level(flow))

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return {f.flow_id: Decision(self._level(f)) for f in flows if self._level(f) != f.level}

    def release(self, flow: Flow, ctx: Context) -> None:
        pass


class CoordinatorThread:
    """An in-process coordinator with ProgressPolicy on its own loop and thread."""

    def __init__(self, token: bytes) -> None:
        config = CoordinatorConfig(
            token=token, policy_factory=ProgressPolicy, timer_period=0.01, metrics_port=None
        )
        self.coordinator = Coordinator(config, registry=CollectorRegistry())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> int:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self.coordinator.start(), self._loop)
        return future.result(10).port

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.coordinator.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def _config(tmp_path: Path, **overrides: object) -> AgentConfig:
    settings: dict[str, object] = dict(
        node="n1",
        socket_path=str(tmp_path / "agent.sock"),
        table_path=str(tmp_path / "table"),
        num_slots=8,
        metrics_port=None,
        interfaces=("lo",),
    )
    settings.update(overrides)
    return AgentConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture(params=[0.0, 5.0], ids=["answered-at-once", "waits-for-coordinator"])
def coordinated_agent(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[AgentThread]:
    token_file = tmp_path / "token"
    with CoordinatorThread(write_token(token_file)) as port:
        config = _config(
            tmp_path,
            coordinator=("127.0.0.1", port),
            token_file=str(token_file),
            fallback_after=30.0,  # every level below comes from the coordinator
            first_level_wait=request.param,
        )
        with AgentThread(config) as running:
            wait_until(lambda: running.agent.connected)
            yield running


def test_coordinator_levels_reach_the_table_in_process(coordinated_agent: AgentThread) -> None:
    agent = coordinated_agent.agent
    with FlowTable.open(str(agent.config.table_path), writable=True) as table:
        slot = EmulatedPluginSlot(table)
        wait_until(lambda: slot.raw_level() == FIRST_LEVEL, timeout=3)
        slot.send(1500)  # the coordinator promotes the flow once it has moved 1,000 bytes
        wait_until(lambda: slot.raw_level() == PROMOTED_LEVEL, timeout=3)
        assert slot.send(1) == PROMOTED_LEVEL  # what the plugin applies on its next isend
        assert agent.fallback is None and agent.stats["levels_written"] >= 2
        slot.close()


def test_a_late_level_for_a_closed_connection_never_reaches_the_slots_next_owner(
    tmp_path: Path,
) -> None:
    agent = Agent(_config(tmp_path, num_slots=1))  # the new connection must take that slot
    agent._attach_table()
    assert agent.table is not None and agent.registry is not None
    try:
        first = EmulatedPluginSlot(agent.table)
        agent.scan_table()
        (old_flow,) = agent.registry.flows
        first.close()
        # before the agent scans again, a new connection takes the CLOSED slot...
        second = EmulatedPluginSlot(agent.table, take_closed=True)
        assert (second.index, second.claim_seq) == (first.index, first.claim_seq + 1)
        # ...and the coordinator's level for the closed flow arrives
        agent.apply_levels([(old_flow, 1)])
        assert second.raw_level() == layout.LEVEL_UNSET, "the new connection got the old level"
        agent.scan_table()  # the new connection becomes a flow of its own
        assert old_flow not in agent.registry.flows and len(agent.registry.flows) == 1
    finally:
        agent.table.close()


def test_opened_comes_before_any_level_push_and_carries_the_first_level(
    coordinated_agent: AgentThread,
) -> None:
    agent = coordinated_agent.agent
    decoder = sdk.SdkDecoder("client")
    messages: list[sdk.SdkMessage] = []
    with _sdk_socket(coordinated_agent) as sock:
        sock.sendall(_open_kv(7))
        while FIRST_LEVEL not in [m.level for m in messages if isinstance(m, LEVELLED)]:
            decoder.feed(sock.recv(65536))
            while (message := decoder.next_message()) is not None:
                messages.append(message)
    first = messages[0]
    assert isinstance(first, sdk.Opened), messages  # a level for an unknown id was dropped
    if agent.config.first_level_wait:
        assert first.level == FIRST_LEVEL  # the coordinator's level, decided while opening
    else:  # the local rmlq's: 1 GB due in 60 s is deferred; the coordinator's 5 follows
        assert first.level == LOCAL_KV_LEVEL, messages
        assert isinstance(messages[-1], sdk.Level) and messages[-1].id == first.id


@contextlib.contextmanager
def _stalled_coordinator(tmp_path: Path, **overrides: object) -> Iterator[AgentThread]:
    """An agent connected to a coordinator that then stops answering (until the block ends)."""
    token_file = tmp_path / "token"
    coordinator = CoordinatorThread(write_token(token_file))
    resume = threading.Event()
    with coordinator as port:
        config = _config(
            tmp_path, coordinator=("127.0.0.1", port), token_file=str(token_file),
            fallback_after=60.0, **overrides,
        )  # fmt: skip
        try:
            with AgentThread(config) as running:
                wait_until(lambda: running.agent.connected)
                coordinator._loop.call_soon_threadsafe(resume.wait, 30)  # the coordinator stalls
                yield running
        finally:
            resume.set()


def _sdk_socket(running: AgentThread) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(running.agent.config.socket_path)
    return sock


def _open_kv(ref: int) -> bytes:
    return sdk.encode(sdk.Open(ref, "kv", size=10**9, deadline=time.time() + 60))


def test_an_open_is_answered_at_once_while_the_coordinator_stalls(tmp_path: Path) -> None:
    """first_level_wait 0: a stalled coordinator does not hold a KV flow's first byte."""
    with _stalled_coordinator(tmp_path) as running, _sdk_socket(running) as sock:
        decoder = sdk.SdkDecoder("client")
        sock.sendall(_open_kv(1))
        decoder.feed(sock.recv(65536))
        first = decoder.next_message()
        assert isinstance(first, sdk.Opened) and first.level == LOCAL_KV_LEVEL, first
        sock.sendall(sdk.encode(sdk.Close(first.id, 10**9)))
        wait_until(lambda: not running.agent._first_admitted)  # released locally


def test_an_open_is_answered_with_the_local_level_while_no_coordinator_answers(
    tmp_path: Path,
) -> None:
    """Not connected yet (and not yet on the local policy): the local copy's level, not the
    class's static default (kv: 1, above the collectives)."""
    with socket.socket() as probe:  # a port nobody listens on: every connect is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token_file = tmp_path / "token"
    write_token(token_file)
    config = _config(
        tmp_path, coordinator=("127.0.0.1", port), token_file=str(token_file), fallback_after=60.0
    )
    with AgentThread(config) as running, _sdk_socket(running) as sock:
        assert not running.agent.connected and running.agent.fallback is None
        decoder = sdk.SdkDecoder("client")
        sock.sendall(_open_kv(1))
        decoder.feed(sock.recv(65536))
        first = decoder.next_message()
        assert isinstance(first, sdk.Opened) and first.level == LOCAL_KV_LEVEL, first


def test_an_open_waiting_for_its_first_level_does_not_hold_up_the_connection(
    tmp_path: Path,
) -> None:
    """The coordinator stalls: the first open waits for its level, and the next one (refused
    at once by the per-user cap) is answered first, not after that wait (audit H2)."""
    with _stalled_coordinator(tmp_path, first_level_wait=30.0) as running:
        assert running.agent.sdk is not None
        running.agent.sdk.max_flows_per_uid = 1
        with _sdk_socket(running) as sock:
            decoder = sdk.SdkDecoder("client")
            sock.sendall(_open_kv(1) + _open_kv(2))
            decoder.feed(sock.recv(65536))
            first = decoder.next_message()
        assert isinstance(first, sdk.Error) and first.ref == 2, first


def _next_of(sock: socket.socket, decoder: sdk.SdkDecoder, kind: type[Any]) -> Any:
    while True:
        while (message := decoder.next_message()) is not None:
            if isinstance(message, kind):
                return message
        decoder.feed(sock.recv(65536))


def test_a_flow_closed_while_its_open_waits_for_its_level_keeps_no_level_pushes(
    tmp_path: Path,
) -> None:
    """A client that learned its flow's id before the answer (``list`` names it) and closed it
    meanwhile: the late answer must not register the connection for that flow's level pushes
    (the entry would outlive the flow and the connection, one per such open)."""
    with _stalled_coordinator(tmp_path, first_level_wait=0.5) as running:
        sdk_server = running.agent.sdk
        assert sdk_server is not None
        with _sdk_socket(running) as sock:
            decoder = sdk.SdkDecoder("client")
            sock.sendall(_open_kv(1) + sdk.encode(sdk.ListFlows()))
            (info,) = _next_of(sock, decoder, sdk.FlowList).flows
            assert info.level is None  # still waiting for the coordinator's level
            sock.sendall(sdk.encode(sdk.Close(info.id, 0)))
            assert _next_of(sock, decoder, sdk.Opened).id == info.id
            assert not running.run(lambda: info.id in sdk_server._owner)


class RecordingPolicy(ProgressPolicy):
    """ProgressPolicy that records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        self.calls.append(("admit", (flow.flow_id,)))
        return super().admit(flow, ctx)

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        flows = list(flows)
        self.calls.append(("reevaluate", tuple(f.flow_id for f in flows)))
        return super().reevaluate(flows, ctx)

    def release(self, flow: Flow, ctx: Context) -> None:
        self.calls.append(("release", (flow.flow_id,)))


def test_the_local_first_level_policy_sees_each_sdk_flow_open_and_close(tmp_path: Path) -> None:
    """Admitted at open, released at close, then told to forget what is idle: a long-lived
    agent's local copy holds no state for flows long gone."""
    agent = Agent(_config(tmp_path))
    agent._attach_table()
    assert agent.registry is not None and agent.table is not None
    recorder = agent._first_policy = RecordingPolicy()
    try:
        flow, _ = agent.registry.open_sdk(1, FlowClass.KV, time.time(), size=10**6)
        agent.decide_first_level(flow)
        assert (flow.level, agent._first_admitted) == (FIRST_LEVEL, {flow.flow_id})
        agent.registry.close_sdk(flow.flow_id, 1, 10**6, time.time())
        agent.admit_now()
        assert recorder.calls == [
            ("admit", (flow.flow_id,)),
            ("release", (flow.flow_id,)),
            ("reevaluate", ()),
        ]
        assert not agent._first_admitted
    finally:
        agent.table.close()


class SwitchPolicy(ProgressPolicy):
    """Level 5 at admission; every re-evaluation moves a flow to 2 once ``promote`` is set."""

    def __init__(self) -> None:
        self.promote = False

    def _level(self, flow: Flow) -> int:
        return PROMOTED_LEVEL if self.promote else FIRST_LEVEL


class HeldLink:
    """A coordinator link (as ``Agent._session`` uses one) whose coordinator says nothing
    until ``speak`` is set, and then only heartbeats."""

    def __init__(self, policy_toml: str) -> None:
        self.welcome = Welcome(policy_toml, 0.01, time.time())
        self.version = PROTOCOL_VERSION
        self.cipher = None
        self.sealed = True
        self.sent: list[object] = []
        self.speak = asyncio.Event()

    async def send(self, message: object) -> None:
        self.sent.append(message)

    async def recv(self, timeout: float | None = None) -> Heartbeat:
        await self.speak.wait()
        await asyncio.sleep(0.01)
        return Heartbeat(time.time())


def _told(link: HeldLink, flow_id: int, level: int) -> bool:
    """Whether the agent sent the coordinator ``flow_id``'s open with ``level`` (resync or
    later report)."""
    return any(
        isinstance(m, Resync | Flows) and any(o.id == flow_id and o.level == level for o in m.opens)
        for m in link.sent
    )


async def _reported_once_connected(agent: Agent, link: HeldLink, flow_id: int, level: int) -> None:
    """Wait until the local policy stopped and the agent told the coordinator ``level``."""
    async with asyncio.timeout(3):
        while agent.fallback is not None or not _told(link, flow_id, level):
            await asyncio.sleep(0.001)


async def _ended(session: asyncio.Task[None]) -> None:
    session.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await session


def test_a_level_the_local_policy_moved_after_the_resync_is_told_to_the_coordinator(
    tmp_path: Path,
) -> None:
    """The local policy runs until the coordinator's first message, but the coordinator has
    the flows' levels from the resync, and sends only the levels it changes: a level the local
    policy moved in between stayed until the coordinator's own decision for the flow changed
    (for good for a flow whose decision never does). The agent now re-sends such a flow's open
    with the level it applies, which makes the coordinator send its own again."""

    async def scenario() -> None:
        agent = Agent(_config(tmp_path, coordinator=("127.0.0.1", 1)))
        agent._attach_table()
        assert agent.registry is not None and agent.table is not None
        policy = SwitchPolicy()
        agent.fallback = policy  # cut off: the policy runs locally
        flow, _ = agent.registry.open_sdk(1, FlowClass.BULK, time.time())
        agent.admit_now()
        assert flow.level == FIRST_LEVEL
        link = HeldLink("")  # not a policy file: the agent keeps its own
        session = asyncio.create_task(agent._session(link))  # type: ignore[arg-type]

        try:
            while not _told(link, flow.flow_id, FIRST_LEVEL):  # the resync
                await asyncio.sleep(0.001)
            policy.promote = True  # a local re-evaluation before the coordinator's first word
            agent._fallback_step()
            assert flow.level == PROMOTED_LEVEL
            link.speak.set()  # its first word: nothing to change (it decides as at admission)
            await _reported_once_connected(agent, link, flow.flow_id, PROMOTED_LEVEL)
        finally:
            await _ended(session)
            agent.table.close()

    asyncio.run(scenario())


class DroppedLink(HeldLink):
    """A coordinator link that ends right after the resync, before any message."""

    async def recv(self, timeout: float | None = None) -> Heartbeat:
        raise LinkClosed("the coordinator went away")


def test_a_policy_adopted_while_the_local_policy_runs_replaces_it(tmp_path: Path) -> None:
    """A coordinator restarted with another policy file (here 4 levels, not 8) that goes away
    again before its first message: the local policy went on as the old policy, deciding
    levels the new one does not have (level 7 of 4, pushed to SDK clients as such)."""
    static = Path(policyfile.__file__).parent / "data" / "policies" / "static-classes.toml"

    async def scenario() -> None:
        agent = Agent(_config(tmp_path, coordinator=("127.0.0.1", 1)))
        agent._attach_table()
        assert agent.registry is not None and agent.table is not None
        try:
            agent._enter_fallback(1.0)
            flow, _ = agent.registry.open_sdk(1, FlowClass.BULK, time.time())
            agent.admit_now()
            assert flow.level == agent.view.num_levels - 1 == 7  # the default policy's last
            with contextlib.suppress(LinkClosed):
                await agent._session(DroppedLink(static.read_text()))  # type: ignore[arg-type]
            assert agent.view.num_levels == 4 and agent.fallback is not None
            agent._fallback_step()
            assert 0 <= flow.level < agent.view.num_levels
        finally:
            agent.table.close()

    asyncio.run(scenario())


class SlowResyncLink(HeldLink):
    """A coordinator link whose coordinator takes the resync late (a full socket buffer: a
    new leader busy with every agent's resync), then says nothing until ``speak``."""

    def __init__(self, policy_toml: str) -> None:
        super().__init__(policy_toml)
        self.sending = asyncio.Event()
        self.taken = asyncio.Event()

    async def send(self, message: object) -> None:
        if isinstance(message, Resync):
            self.sending.set()
            await self.taken.wait()
        await super().send(message)


def test_a_level_moved_by_a_local_policy_started_during_the_resync_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's silence passes fallback_after while the resync waits on a full socket
    buffer: the local policy starts then, after the resync reported the flows' levels, and
    moves one before the coordinator's first message. That level, too, must be re-reported
    (the coordinator sends only the levels it changes)."""
    policy = SwitchPolicy()
    policy.promote = True
    monkeypatch.setattr(policyfile.PolicyConfig, "make_policy", lambda self: policy)

    async def scenario() -> None:
        agent = Agent(_config(tmp_path, coordinator=("127.0.0.1", 1), fallback_after=0.05))
        agent._attach_table()
        assert agent.registry is not None and agent.table is not None
        flow, _ = agent.registry.open_sdk(1, FlowClass.BULK, time.time())
        agent.admit_now()
        agent.apply_levels([(flow.flow_id, FIRST_LEVEL)])  # the previous coordinator's level
        link = SlowResyncLink("")  # not a policy file: the agent keeps its own
        session = asyncio.create_task(agent._session(link))  # type: ignore[arg-type]

        try:
            await link.sending.wait()  # the resync (level 5) is on its way, not taken yet
            agent._last_rx = time.monotonic() - 1.0  # the coordinator silent past fallback_after
            agent._fallback_step()
            assert agent.fallback is policy and flow.level == PROMOTED_LEVEL
            link.taken.set()
            async with asyncio.timeout(3):
                while not _told(link, flow.flow_id, FIRST_LEVEL):
                    await asyncio.sleep(0.001)
            link.speak.set()  # the coordinator's first word
            await _reported_once_connected(agent, link, flow.flow_id, PROMOTED_LEVEL)
        finally:
            await _ended(session)
            agent.table.close()

    asyncio.run(scenario())
