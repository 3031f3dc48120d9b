"""The coordinator service in-process: real sockets on port 0, agents via the asyncio helper."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from coordinator_helpers import (
    TOKEN,
    DeadlineStepPolicy,
    connect_as,
    next_levels,
    running_coordinator,
    scrape,
    wait_until,
)

from flowsched.coordinator import Coordinator
from flowsched.model import FlowClass
from flowsched.protocol import (
    FRAME_MAC_VERSION,
    PROTOCOL_VERSION,
    RESYNC_FRAME_OPENS,
    Challenge,
    Connection,
    FlowClose,
    FlowOpen,
    Flows,
    Heartbeat,
    Levels,
    LevelUpdate,
    Message,
    NicLoad,
    NicLoadEntry,
    Resync,
    Role,
    Sentinel,
    Welcome,
    encode_body,
)
from flowsched.protocol.aio import AgentLink, HandshakeError, LinkClosed, connect_agent


def _open(wire_id: int, **kw: object) -> FlowOpen:
    return FlowOpen(wire_id, FlowClass.KV, time.time(), **kw)


@pytest.mark.asyncio
async def test_agent_reports_flows_and_receives_only_its_level_changes() -> None:
    async with running_coordinator() as coordinator:
        first, second = await connect_as(coordinator, "n1"), await connect_as(coordinator, "n2")
        try:
            assert first.welcome is not None and first.welcome.heartbeat_interval == 0.2
            await first.send(Resync(()))
            await first.send(Flows(opens=(_open(1), _open(2))))
            assert set((await next_levels(first)).updates) == {
                LevelUpdate(1, 7),
                LevelUpdate(2, 7),
            }
            await first.send(Flows(progress_ids=(2,), progress_sent=(250,)))
            assert (await next_levels(first)).updates == (LevelUpdate(2, 5),)
            with pytest.raises(TimeoutError):
                await next_levels(second, timeout=0.3)  # n2 has no flows: no levels for it
        finally:
            await first.close()
            await second.close()


@pytest.mark.asyncio
async def test_progress_as_maps_and_as_arrays_moves_flows_alike() -> None:
    # an agent of the previous release (protocol 1: progress as maps) next to a new one
    # (protocol 2: arrays): the same reports give the same level changes
    async with running_coordinator() as coordinator:
        assert coordinator.addresses is not None
        old = await connect_agent(
            coordinator.addresses.host, coordinator.addresses.port,
            node="old", token=TOKEN, timeout=5, version=1,
            allow_unproven=True,  # (as that release's agent: it did not check the coordinator)
        )  # fmt: skip
        new = await connect_as(coordinator, "new")
        try:
            assert (old.version, new.version) == (1, PROTOCOL_VERSION)
            for link in (old, new):
                await link.send(Resync(()))
                await link.send(Flows(opens=(_open(1), _open(2))))
                assert {u.level for u in (await next_levels(link)).updates} == {7}
                await link.send(Flows(progress_ids=(2, 1), progress_sent=(250, 0)))
                assert (await next_levels(link)).updates == (LevelUpdate(2, 5),)
            flows = coordinator.state.flows.values()
            assert sorted((f.node, f.sent) for f in flows) == [
                ("new", 0), ("new", 250), ("old", 0), ("old", 250),
            ]  # fmt: skip
        finally:
            await old.close()
            await new.close()


@pytest.mark.asyncio
async def test_metrics_endpoint_reflects_live_state() -> None:
    async with running_coordinator() as coordinator:
        link = await connect_as(coordinator, "n1")
        try:
            deadline = time.time() + 60
            await link.send(Flows(opens=(_open(1, deadline=deadline), _open(2, sent=700))))
            await link.send(NicLoad((NicLoadEntry("n1:tx", 12.5e9, 0.25),)))
            await link.send(Flows(closes=(FlowClose(1, 10, time.time()),)))
            await next_levels(link)
            text = await scrape(coordinator)
        finally:
            await link.close()
    assert 'flowsched_coordinator_active_flows{class="kv",level="0"} 1.0' in text
    assert "flowsched_coordinator_agents_connected 1.0" in text
    assert 'flowsched_coordinator_completed_flows_total{class="kv",deadline="met"} 1.0' in text
    assert 'flowsched_coordinator_link_utilization_ratio{link="n1:tx"} 0.25' in text
    assert 'flowsched_coordinator_link_bandwidth_bytes_per_second{link="n1:tx"} 1.25e+10' in text
    assert 'flowsched_coordinator_events_total{kind="open"} 2.0' in text
    assert "flowsched_coordinator_decision_latency_seconds_count" in text
    assert "flowsched_coordinator_deadline_earliness_seconds_count 1.0" in text
    assert "flowsched_coordinator_deadline_lateness_seconds_count 0.0" in text
    assert 'flowsched_build_info{compiled="' in text and "process_cpu_seconds_total" in text


@pytest.mark.asyncio
async def test_wrong_token_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flowsched.coordinator")
    async with running_coordinator() as coordinator:
        with pytest.raises(HandshakeError) as info:
            await connect_as(coordinator, "intruder", token=b"not-the-token-at-all")
        assert info.value.code == "auth_failed"
        assert coordinator.agent_count() == 0
        await asyncio.sleep(0.05)
    assert "node=intruder state=error: auth_failed: auth.mac: wrong MAC" in caplog.text


@pytest.mark.asyncio
async def test_quick_reconnect_keeps_flows_and_grace_expiry_drops_them() -> None:
    async with running_coordinator(grace_period=0.5) as coordinator:
        link = await connect_as(coordinator, "n1")
        await link.send(Flows(opens=(_open(1), _open(2, sent=300))))
        await next_levels(link)
        await link.close()
        await asyncio.sleep(0.1)
        assert len(coordinator.state.flows) == 2  # kept during the grace period
        link = await connect_as(coordinator, "n1")
        await link.send(Resync((_open(1, level=7), _open(2, level=6))))
        levels = await next_levels(link)
        assert levels.updates == (LevelUpdate(2, 4),)  # only the level the agent had wrong
        await link.close()
        closed = time.monotonic()
        await wait_until(lambda: not coordinator.state.flows, 5.0, "the flows to be dropped")
        assert time.monotonic() - closed >= 0.5  # dropped after the grace period, not before


@pytest.mark.asyncio
async def test_a_level_lost_with_the_old_connection_is_sent_again_after_the_resync() -> None:
    # The agent's open reached the coordinator, but the levels frame answering it went to a
    # connection that was already dying: the agent resyncs the flow with no level (it never
    # got one), and must be told the level the coordinator holds for it.
    async with running_coordinator() as coordinator:
        old = await connect_as(coordinator, "n1")
        await old.send(Flows(opens=(_open(1), _open(2, sent=300))))
        await wait_until(lambda: len(coordinator.state.flows) == 2, 3.0, "the opens to arrive")
        await old.close()  # the levels answering them are lost
        await wait_until(lambda: coordinator.agent_count() == 0, 3.0, "the old session to end")
        new = await connect_as(coordinator, "n1")
        try:
            await new.send(Resync((_open(1), _open(2, sent=300, level=4))))
            levels = await next_levels(new, timeout=1.0)
            assert levels.updates == (LevelUpdate(1, 7),)  # not flow 2: the agent has its level
        finally:
            await new.close()


@pytest.mark.asyncio
async def test_a_resync_in_several_frames_keeps_the_flows_of_its_later_frames() -> None:
    """A flow set larger than one frame: a full ``resync``, then ``flows`` frames of opens
    alone. The flows of the later frames were dropped by the ``resync`` and admitted again
    with new ids (strikes, rates, policy state lost); a flow no frame names goes once the
    agent sends anything else (here a heartbeat)."""
    full = RESYNC_FRAME_OPENS
    opens = [_open(i) for i in range(full + 50)]
    async with running_coordinator() as coordinator:
        state = coordinator.state
        old = await connect_as(coordinator, "n1")
        await old.send(Flows(opens=tuple(opens[:full])))
        await old.send(Flows(opens=(*opens[full:], _open(999))))  # 999: closed while away
        await wait_until(lambda: len(state.flows) == full + 51, 3.0, "the opens to arrive")
        before = dict(state.by_node["n1"])
        await old.close()
        await wait_until(lambda: coordinator.agent_count() == 0, 3.0, "the old session to end")
        new = await connect_as(coordinator, "n1")
        try:
            again = [replace(op, level=7) for op in opens]
            await new.send(Resync(tuple(again[:full])))
            await new.send(Flows(opens=tuple(again[full:])))
            await new.send(Heartbeat(time.time()))  # the resync is complete
            await wait_until(lambda: 999 not in state.by_node["n1"], 3.0, "the stale flow to go")
            assert state.by_node["n1"] == {i: before[i] for i in range(full + 50)}
            assert state.stats.events["resync_flow"] == full + 50
        finally:
            await new.close()


async def _reconnect_at_the_cap(coordinator: Coordinator, full: int) -> AgentLink:
    """Node n1 with ``full + 1`` flows open (its cap), then its agent connected anew (a split
    resync to come): the new connection."""
    state = coordinator.state
    old = await connect_as(coordinator, "n1")
    await old.send(Flows(opens=tuple(_open(i) for i in range(full + 1))))  # at the cap
    await wait_until(lambda: len(state.flows) == full + 1, 3.0, "the opens to arrive")
    await old.close()
    await wait_until(lambda: coordinator.agent_count() == 0, 3.0, "the old session to end")
    return await connect_as(coordinator, "n1")


@pytest.mark.asyncio
async def test_a_flow_a_split_resync_holds_past_the_cap_is_refused_at_its_end_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new flow of a split resync that finds its node at --max-flows-per-node waits for the
    end of the resync (the unnamed flows may make room); refused then, it is logged then."""
    caplog.set_level(logging.WARNING, logger="flowsched.coordinator")
    full = RESYNC_FRAME_OPENS
    async with running_coordinator(max_flows_per_node=full + 1) as coordinator:
        state = coordinator.state
        new = await _reconnect_at_the_cap(coordinator, full)
        try:
            await new.send(Resync(tuple(_open(i) for i in range(full))))
            await new.send(Flows(opens=(_open(999),)))  # new: held, flow `full` may go
            await new.send(Flows(opens=(_open(full),)))  # it does not: no room at the end
            await wait_until(
                lambda: state.stats.events["resync_flow"] == full + 1, 3.0, "the resync frames"
            )
            assert "refused" not in caplog.text  # undecided until the end of the resync
            await new.send(Heartbeat(time.time()))  # the resync is complete
            await wait_until(lambda: state.stats.refused_opens == 1, 3.0, "the refusal")
            assert 999 not in state.by_node["n1"]
            assert "node n1 has 201 flows open" in caplog.text
            assert "1 more refused" in caplog.text
        finally:
            await new.close()


@pytest.mark.asyncio
async def test_a_heartbeat_that_ends_a_split_resync_sends_what_its_end_decided() -> None:
    """The end of a split resync admits the flows it held past the cap: when an idle agent's
    heartbeat ended it, their levels waited for some other agent's frame (the heartbeat
    scheduled no flush, and promotion timers with none due flush nothing)."""
    full = RESYNC_FRAME_OPENS
    async with running_coordinator(
        max_flows_per_node=full + 1, policy_factory=DeadlineStepPolicy, rebuild_batching=False
    ) as coordinator:
        state = coordinator.state
        new = await _reconnect_at_the_cap(coordinator, full)
        try:
            await new.send(Resync(tuple(_open(i, level=7) for i in range(full))))
            await new.send(Flows(opens=(_open(999),)))  # held: flow `full` may go
            split = state.split_resyncs
            await wait_until(lambda: "n1" in split and split["n1"].held, 3.0, "999 to be held")
            await new.send(Heartbeat(time.time()))  # the resync is complete: `full` goes
            assert (await next_levels(new, timeout=2.0)).updates == (LevelUpdate(999, 7),)
        finally:
            await new.close()


@pytest.mark.asyncio
async def test_newer_connection_of_a_node_replaces_the_older() -> None:
    async with running_coordinator() as coordinator:
        old = await connect_as(coordinator, "n1")
        new = await connect_as(coordinator, "n1")
        try:
            with pytest.raises(LinkClosed):
                while True:
                    await old.recv(2.0)
            assert coordinator.agent_count() == 1
            await new.send(Flows(opens=(_open(5),)))
            assert (await next_levels(new)).updates == (LevelUpdate(5, 7),)
        finally:
            await old.close()
            await new.close()


@pytest.mark.asyncio
async def test_silent_agent_is_dropped_after_the_idle_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="flowsched.coordinator")
    async with running_coordinator(idle_timeout=0.3) as coordinator:
        link = await connect_as(coordinator, "quiet")
        try:
            with pytest.raises(LinkClosed) as info:
                while True:
                    await link.recv(2.0)
            assert info.value.error is not None and info.value.error.code == "timeout"
        finally:
            await link.close()
    assert re.search(r"node=quiet state=established: timeout: no byte for 0\.\d s", caplog.text)


@pytest.mark.asyncio
async def test_heartbeats_keep_an_idle_agent_connected() -> None:
    async with running_coordinator(idle_timeout=0.5) as coordinator:
        link = await connect_as(coordinator, "n1")
        try:
            for _ in range(8):
                assert isinstance(await link.recv(1.0), Heartbeat | Levels)
                await link.send(Heartbeat(time.time()))
            assert coordinator.agent_count() == 1
        finally:
            await link.close()


@pytest.mark.asyncio
async def test_stuck_agent_is_disconnected_when_its_send_queue_overflows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="flowsched.coordinator")
    async with running_coordinator(send_buffer_limit=-1) as coordinator:
        link = await connect_as(coordinator, "slow")
        try:
            with pytest.raises(LinkClosed):
                while True:
                    await link.recv(2.0)
        finally:
            await link.close()
        await asyncio.sleep(0.05)
    assert "node=slow state=established: send_overflow" in caplog.text


@pytest.mark.asyncio
async def test_frames_after_the_one_that_ended_the_connection_do_not_act() -> None:
    # Unbatched, the first frame's levels overflow the send queue (a limit below any queue):
    # the connection is aborted while the rest of the received chunk is still undecoded.
    async with running_coordinator(
        batching=False, send_buffer_limit=-1, heartbeat_interval=30, idle_timeout=60
    ) as coordinator:
        link = await connect_as(coordinator, "n1")
        try:
            frames = b"".join(
                link._conn.send(Flows(opens=(_open(wire_id),))) for wire_id in (1, 2, 3)
            )
            link._writer.write(frames)  # one write: one chunk for the coordinator
            with pytest.raises(LinkClosed):
                while True:
                    await link.recv(2.0)
        finally:
            await link.close()
        await wait_until(lambda: coordinator.agent_count() == 0, 2.0, "the connection's end")
        opened = sorted(wire_id for _, wire_id in coordinator.state.origin.values())
    assert opened == [1]


@pytest.mark.asyncio
async def test_unbatched_mode_gives_the_same_decisions() -> None:
    async with running_coordinator(batching=False) as coordinator:
        link = await connect_as(coordinator, "n1")
        try:
            await link.send(Flows(opens=(_open(1),), progress_ids=(1,), progress_sent=(120,)))
            assert (await next_levels(link)).updates == (LevelUpdate(1, 6),)
        finally:
            await link.close()


@pytest.mark.parametrize(
    ("max_batch_delay", "busy", "flushed_in_turn"),
    [
        pytest.param(60.0, 0.0, 0, id="short-batch-waits-for-the-turn"),
        pytest.param(0.001, 0.003, 2, id="long-batch-flushed-mid-turn"),
        pytest.param(0.0, 0.0, 2, id="zero-delay-flushes-every-frame"),
        pytest.param(math.inf, 0.003, 0, id="inf-once-per-turn"),
    ],
)
@pytest.mark.asyncio
async def test_a_batch_is_flushed_once_it_has_collected_for_max_batch_delay(
    max_batch_delay: float, busy: float, flushed_in_turn: int
) -> None:
    """Two frames in one loop turn, ``busy`` seconds of work apart: without yielding to the
    loop the scheduled per-turn flush cannot run, so a decision observed before the turn ends
    was flushed by the delay bound."""
    from coordinator_helpers import BytesPolicy
    from prometheus_client import CollectorRegistry

    from flowsched.coordinator import CoordinatorConfig

    config = CoordinatorConfig(
        token=TOKEN, policy_factory=BytesPolicy, max_batch_delay=max_batch_delay
    )
    coordinator = Coordinator(config, registry=CollectorRegistry())
    latency = coordinator.live.decision_latency
    coordinator.handle("n1", Flows(opens=(_open(1),)), time.perf_counter())
    until = time.perf_counter() + busy
    while time.perf_counter() < until:  # the turn's other work (no yield to the loop)
        pass
    coordinator.handle("n1", Flows(opens=(_open(2),)), time.perf_counter())
    assert len(coordinator.state.flows) == 2
    assert latency.count == flushed_in_turn
    await asyncio.sleep(0)  # the loop turn ends: the scheduled flush takes the rest
    assert latency.count == 2


@pytest.mark.parametrize("version", [FRAME_MAC_VERSION - 1, FRAME_MAC_VERSION])
@pytest.mark.asyncio
async def test_frames_pipelined_right_after_auth_are_handled_without_more_data(
    version: int,
) -> None:
    async with running_coordinator() as coordinator:
        assert coordinator.addresses is not None
        reader, writer = await asyncio.open_connection(
            coordinator.addresses.host, coordinator.addresses.port
        )
        conn = Connection(Role.AGENT, token=TOKEN, version=version)
        try:
            writer.write(conn.hello("eager"))
            challenge = await _receive(reader, conn)
            assert isinstance(challenge, Challenge)
            # auth, resync and flows in one write (built by hand: the sans-IO agent end waits
            # for welcome first, and seals what it sends after its auth from version 5);
            # nothing else will follow
            auth = conn.answer(challenge)
            early = (Resync(()), Flows(opens=(_open(1),)))
            writer.write(auth + b"".join(conn._framed(encode_body(m)) for m in early))
            assert isinstance(await _receive(reader, conn), Welcome)
            levels = await _receive(reader, conn, skip=Heartbeat)
            assert levels == Levels((LevelUpdate(1, 7),))
        finally:
            writer.close()


async def _receive(
    reader: asyncio.StreamReader, conn: Connection, skip: type | None = None
) -> Message:
    async with asyncio.timeout(3):
        while True:
            event = conn.next_event()
            if isinstance(event, Sentinel):
                conn.receive_data(await reader.read(65536))
            elif skip is None or not isinstance(event, skip):
                return event


@pytest.mark.asyncio
async def test_a_new_coordinator_rebuilds_state_from_resyncs_within_two_seconds() -> None:
    agents, flows_per_agent = 50, 200
    async with running_coordinator() as coordinator:
        links = [await connect_as(coordinator, f"n{i}") for i in range(agents)]
        try:
            started = time.monotonic()
            opens = tuple(_open(i, level=7) for i in range(flows_per_agent))
            await asyncio.gather(*(link.send(Resync(opens)) for link in links))
            async with asyncio.timeout(10):
                while len(coordinator.state.flows) < agents * flows_per_agent:
                    await asyncio.sleep(0.01)
            rebuilt = time.monotonic() - started
        finally:
            await asyncio.gather(*(link.close() for link in links))
    assert rebuilt < 2.0, f"rebuilding {agents * flows_per_agent} flows took {rebuilt:.2f} s"


@pytest.mark.asyncio
async def test_a_replaced_connection_is_told_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flowsched.coordinator")
    async with running_coordinator() as coordinator:
        old = await connect_as(coordinator, "n1")
        new = await connect_as(coordinator, "n1")
        try:
            with pytest.raises(LinkClosed) as closed:
                while True:
                    await old.recv(2.0)
            assert closed.value.error is not None and closed.value.error.code == "replaced"
            assert "two agents use the same --node name" in caplog.text
        finally:
            await old.close()
            await new.close()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        pytest.param({"idle_timeout": 0.2}, "idle_timeout", id="idle-equals-heartbeat"),
        pytest.param({"idle_timeout": 0.1}, "idle_timeout", id="idle-below-heartbeat"),
        pytest.param({"heartbeat_interval": 0.0}, "heartbeat_interval", id="zero-heartbeat"),
        pytest.param({"idle_timeout": float("nan")}, "idle_timeout", id="nan-idle"),
        pytest.param({"handshake_timeout": float("inf")}, "handshake_timeout", id="inf-handshake"),
        pytest.param({"max_batch_delay": -0.001}, "max_batch_delay", id="negative-batch-delay"),
        pytest.param({"max_batch_delay": float("nan")}, "max_batch_delay", id="nan-batch-delay"),
        pytest.param({"max_flows_per_node": 0}, "max_flows_per_node", id="no-flows-per-node"),
        pytest.param({"max_flows_per_node": 1.5}, "max_flows_per_node", id="fractional-cap"),
        pytest.param({"max_flows_per_node": True}, "max_flows_per_node", id="bool-cap"),
        pytest.param({"min_agent_version": 0}, "min_agent_version", id="no-version-0"),
        pytest.param({"min_agent_version": 6}, "min_agent_version", id="above-this-release"),
    ],
)
def test_config_refuses_timeouts_that_cannot_work(overrides: dict[str, float], field: str) -> None:
    from coordinator_helpers import BytesPolicy

    from flowsched.coordinator import CoordinatorConfig

    with pytest.raises(ValueError, match=field):
        CoordinatorConfig(token=TOKEN, policy_factory=BytesPolicy, **overrides)


@pytest.mark.asyncio
async def test_a_minimum_agent_version_refuses_older_agents() -> None:
    """--min-agent-version 5: an agent offering 4 (an older release, or a downgrade on the
    path) is refused before its auth, so no unsealed session opens in any node's name."""
    async with running_coordinator(min_agent_version=FRAME_MAC_VERSION) as coordinator:
        with pytest.raises(HandshakeError) as info:
            await connect_as(coordinator, "old", version=FRAME_MAC_VERSION - 1)
        # refused with code "version"; the agent end does not try again with version 1
        assert "unsupported version 4 (this end speaks 5..5)" in info.value.reason
        assert coordinator.live.rejected == {"version": 1}
        link = await connect_as(coordinator, "new")
        try:
            assert (link.version, link.sealed) == (FRAME_MAC_VERSION, True)
        finally:
            await link.close()


def test_policy_file_too_big_for_the_welcome_frame_is_refused(tmp_path: Path) -> None:
    """The coordinator hands its policy file to every agent in one frame: a file that cannot
    fit would let the coordinator start and every agent's handshake fail, forever."""
    from flowsched.coordinator.config import CoordinatorConfig
    from flowsched.policyfile import PolicyFileError

    samples = ", ".join(str(1000 + i) for i in range(150_000))
    path = tmp_path / "huge.toml"
    path.write_text(f'[policy]\nname = "pias"\n[policy.args]\nsize_samples = [{samples}]\n')
    with pytest.raises(PolicyFileError, match="does not fit in a protocol frame"):
        CoordinatorConfig.from_policy_file(path, TOKEN)
    path.write_text('[policy]\nname = "pias"\n[policy.args]\nsize_samples = [1000, 2000]\n')
    assert CoordinatorConfig.from_policy_file(path, TOKEN).policy_text == path.read_text()


#: what the welcome a coordinator sends adds to the one without its optional fields: a MAC, an
#: epoch and a fencing scope (from an election) at their widest
WIDEST_WELCOME: dict[str, Any] = {"epoch": 2**64 - 1, "cluster": 2**64 - 1, "mac": bytes(32)}


def _policy_of_welcome_size(size: int, fields: dict[str, Any]) -> str:
    """A valid policy file whose welcome (with ``fields``) is ``size`` bytes of body: the
    default policy, padded with a comment."""
    from flowsched.protocol import Welcome, encode_body

    base = "# " + "x" * (size - 16 * 1024) + '\n[policy]\nname = "static"\n'
    grown = len(encode_body(Welcome(base, 0.05, 0.0, **fields)))
    padded = base.replace("# ", "# " + "x" * (size - grown), 1)
    assert len(encode_body(Welcome(padded, 0.05, 0.0, **fields))) == size
    return padded


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        pytest.param({}, True, id="fits-only-without-mac-and-epoch"),
        pytest.param(WIDEST_WELCOME, False, id="fits-with-every-field"),
    ],
)
def test_the_welcome_size_check_counts_the_fields_every_real_welcome_carries(
    tmp_path: Path, fields: dict[str, Any], refused: bool
) -> None:
    """The check measured a welcome without its MAC, epoch and fencing scope: a file within
    70 bytes of the limit passed it, and then every handshake failed (an ``internal`` error
    logged for each agent, forever)."""
    from flowsched.coordinator.config import CoordinatorConfig
    from flowsched.policyfile import PolicyFileError
    from flowsched.protocol import DEFAULT_MAX_FRAME_SIZE

    path = tmp_path / "big.toml"
    path.write_text(_policy_of_welcome_size(DEFAULT_MAX_FRAME_SIZE, fields))
    if refused:
        with pytest.raises(PolicyFileError, match="does not fit in a protocol frame"):
            CoordinatorConfig.from_policy_file(path, TOKEN)
    else:
        assert CoordinatorConfig.from_policy_file(path, TOKEN).policy_text == path.read_text()


@pytest.mark.asyncio
async def test_an_agent_receiving_level_updates_gets_no_heartbeats_and_stays_connected() -> None:
    interval = 0.2  # the default: a level update comes far more often even on a loaded machine
    async with running_coordinator(heartbeat_interval=interval, idle_timeout=2.0) as coordinator:
        link = await connect_as(coordinator, "busy")
        try:
            started, beats, levels = time.monotonic(), 0, 0
            wire_id = 0
            while time.monotonic() - started < 10 * interval:
                wire_id += 1  # each new flow's admission sends this agent a level update
                await link.send(Flows(opens=(_open(wire_id),)))
                while not isinstance(message := await link.recv(2.0), Levels):
                    beats += isinstance(message, Heartbeat)
                levels += 1
            # anything sent within a heartbeat interval stands for the heartbeat: a busy
            # link carries (next to) none, and the agent, which counts every frame as a sign
            # of life, keeps the link
            assert levels >= 10
            assert beats <= 3, (beats, levels)
            assert coordinator.agent_count() == 1
            # once the level updates stop, heartbeats come again
            assert isinstance(await link.recv(5 * interval), Heartbeat)
            assert isinstance(await link.recv(5 * interval), Heartbeat)
        finally:
            await link.close()


@pytest.mark.asyncio
async def test_the_idle_watchdog_closes_a_silent_agent_after_the_timeout_not_before() -> None:
    idle = 0.4
    async with running_coordinator(idle_timeout=idle, heartbeat_interval=0.05) as coordinator:
        link = await connect_as(coordinator, "talks-then-stops")
        try:
            for _ in range(3):  # a talking agent outlives several idle timeouts
                await link.send(Heartbeat(time.time()))
                await asyncio.sleep(idle / 2)
            assert coordinator.agent_count() == 1
            await link.send(Flows(opens=(_open(1),)))  # its last frame
            last_sent = time.monotonic()
            with pytest.raises(LinkClosed) as info:
                while True:
                    await link.recv(5.0)
            silent = time.monotonic() - last_sent
        finally:
            await link.close()
        assert info.value.error is not None and info.value.error.code == "timeout"
        assert silent >= idle, silent
        assert coordinator.live.rejected == {"timeout": 1}


@pytest.mark.asyncio
async def test_frames_followed_at_once_by_the_end_of_the_stream_are_handled() -> None:
    async with running_coordinator() as coordinator:
        link = await connect_as(coordinator, "brief")
        link._writer.write(link._conn.send(Flows(opens=(_open(1), _open(2)))))
        link._writer.write_eof()  # the frame and the FIN may arrive in one read
        await wait_until(lambda: coordinator.agent_count() == 0, 5.0, "the agent to be detached")
        await link.close()
        assert len(coordinator.state.flows) == 2  # kept for the grace period
        assert coordinator.live.rejected == {"peer_closed": 1}


class SweepCounting:
    """The cluster state it wraps, noting when each timer tick (``start_sweep``) comes (a
    wrapper, not a patched method: the compiled ClusterState's methods are read-only)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.ticks: list[float] = []

    def start_sweep(self, now: float | None = None) -> bool:
        self.ticks.append(time.monotonic())
        swept: bool = self._inner.start_sweep(now)
        return swept

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@pytest.mark.asyncio
async def test_the_timer_loop_sleeps_until_a_promotion_is_due_and_it_fires_on_time() -> None:
    """With promotion timers the loop waits for the earliest timer instead of looking every
    timer period (an idle coordinator woke 1,000 times a second); a timer armed while it
    sleeps wakes it, so the flow is promoted at its time without any report from the agent."""
    last_moment = functools.partial(DeadlineStepPolicy, lead=0.2)
    async with running_coordinator(policy_factory=last_moment, timer_period=0.001) as co:
        counting = SweepCounting(co.state)
        ticks = counting.ticks
        co.state = counting  # type: ignore[assignment]
        await asyncio.sleep(0.3)
        assert len(ticks) <= 2, len(ticks)  # no timer armed: nothing to look at
        link = await connect_as(co, "n1")
        try:
            deadline = time.time() + 0.6
            await link.send(Flows(opens=(_open(1, deadline=deadline),)))
            assert [u.level for u in (await next_levels(link)).updates] == [7]
            promoted = (await next_levels(link, timeout=2.0)).updates
            assert [u.level for u in promoted] == [0]
            late = promoted[0].decided_at - (deadline - 0.2)
            assert 0 <= late < 0.1, late
        finally:
            await link.close()
