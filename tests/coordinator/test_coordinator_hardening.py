"""What one agent (or peer) may do to the others: links it may report and send on, the metrics
its link names make, a policy failure on its flow, connections that linger, bugs and text
that reach the log (docs/security.md, "What the coordinator refuses")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping

import pytest
from coordinator_helpers import (
    TOKEN,
    BytesPolicy,
    connect_as,
    next_levels,
    running_coordinator,
    scrape,
    wait_until,
)

from flowsched.agent.flows import FlowRegistry
from flowsched.agent.nic import flow_links
from flowsched.coordinator.connection import CLOSE_TIMEOUT
from flowsched.coordinator.service import check_flow_links, check_nic_load
from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.protocol import (
    Challenge,
    Connection,
    FlowOpen,
    Flows,
    JobProgress,
    Levels,
    Message,
    NicLoad,
    NicLoadEntry,
    RemoteProtocolError,
    Resync,
    Role,
)
from flowsched.protocol.aio import AgentLink, LinkClosed


async def _closed_with(link: AgentLink) -> str | None:
    """The code of the error frame the coordinator closed ``link`` with (None: none)."""
    with pytest.raises(LinkClosed) as closed:
        while True:
            await link.recv(3.0)
    return closed.value.error.code if closed.value.error is not None else None


def _open(wire_id: int, links: tuple[str, ...] = ()) -> FlowOpen:
    return FlowOpen(wire_id, FlowClass.KV, time.time(), links=links)


# -- which links an agent may name -------------------------------------------------------------


def _agent_links() -> list[tuple[str, ...]]:
    """The links real agents of node n1 give their flows (flowsched.agent)."""
    registry = FlowRegistry(node="n1", links=flow_links("n1"), id_prefix=1)
    sdk = [
        registry.open_sdk(1, FlowClass.KV, 0.0, dst_node=dst)[0].links
        for dst in (None, "n1", "n2", "gpu-node-7.cluster.local")
    ]
    return [*sdk, flow_links("n1"), flow_links("n1", "n2"), flow_links("n1", "n1"), ()]


@pytest.mark.parametrize("links", _agent_links())
def test_every_link_set_a_real_agent_sends_is_accepted(links: tuple[str, ...]) -> None:
    check_flow_links("n1", (_open(1, links),), "flows.opens")


@pytest.mark.parametrize(
    ("links", "refused"),
    [
        (("n2:tx",), "n2:tx"),  # another node's egress
        (("n1:tx", "n2:tx"), "n2:tx"),
        (("eth0",), "eth0"),
        (("n1/eth0",), "n1/eth0"),
        (("n1:txx",), "n1:txx"),
        (("n1:tx:rx:tx",), "n1:tx:rx:tx"),
    ],
)
def test_a_flow_on_another_nodes_egress_is_refused(links: tuple[str, ...], refused: str) -> None:
    opens = (_open(1, flow_links("n1")), _open(2, links))
    with pytest.raises(RemoteProtocolError) as error:
        check_flow_links("n1", opens, "resync.opens")
    assert error.value.code == "bad_field"
    assert error.value.reason.startswith(f"resync.opens[1].links: {refused!r}")


@pytest.mark.parametrize(
    ("link", "refusal"),
    [
        ("n1:tx", None),
        ("n1:rx", "is named twice"),
        ("n2:tx", "is not a link of node 'n1'"),
        ("n2:rx", "is not a link of node 'n1'"),
        ("n1", "is not a link of node 'n1'"),
        ("eth0", "is not a link of node 'n1'"),
        ("n1:tx ", "is not a link of node 'n1'"),
    ],
)
def test_an_agent_reports_the_load_of_its_own_links_once(link: str, refusal: str | None) -> None:
    entries = (NicLoadEntry("n1:rx", 1e9, 0.1), NicLoadEntry(link, 0.0, 0.0))
    if refusal is None:
        check_nic_load("n1", entries)
        return
    with pytest.raises(RemoteProtocolError) as error:
        check_nic_load("n1", entries)
    assert error.value.code == "bad_field"
    assert error.value.reason.startswith(f"nic_load.entries[1].link: {link!r} {refusal}")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "poison",
    [
        pytest.param(NicLoad((NicLoadEntry("evil:tx", 1e9, 0.0), NicLoadEntry("victim:tx", 0, 0))),
                     id="nic_load"),
        pytest.param(Flows(opens=(_open(1, ("evil:tx",)), _open(2, ("victim:tx",)))), id="flows"),
        pytest.param(Resync((_open(1, ("evil:tx",)), _open(2, ("victim:tx",)))), id="resync"),
    ],
)  # fmt: skip
async def test_an_agent_cannot_touch_another_nodes_link(poison: Message) -> None:
    async with running_coordinator() as coordinator:
        victim, evil = (
            await connect_as(coordinator, "victim"),
            await connect_as(coordinator, "evil"),
        )
        try:
            await victim.send(NicLoad((NicLoadEntry("victim:tx", 12.5e9, 0.1),)))
            await victim.send(Flows(opens=(_open(1, ("victim:tx",)),)))
            await next_levels(victim)
            await evil.send(poison)
            assert await _closed_with(evil) == "bad_field"
            # nothing of the frame was applied, and the victim's link and connection stand
            assert coordinator.state.link_bandwidth == {"victim:tx": 12.5e9}
            assert "evil" not in coordinator.state.by_node or not coordinator.state.by_node["evil"]
            await victim.send(Flows(progress_ids=(1,), progress_sent=(100,)))
            assert (await next_levels(victim)).updates[0].level == 6
            assert coordinator.live.rejected == {"bad_field": 1}
        finally:
            await victim.close()
            await evil.close()


# -- a policy failure on one node's flow -----------------------------------------------------


class _EvilFlowRaises(BytesPolicy):
    """BytesPolicy that raises on node "evil"'s flows (as rmlq did on a poisoned link)."""

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        flows = list(flows)
        if any(flow.node == "evil" for flow in flows):
            raise ZeroDivisionError("float division by zero")
        return super().reevaluate(flows, ctx)


@pytest.mark.asyncio
@pytest.mark.parametrize("batching", [False, True])
async def test_a_policy_failure_on_one_flow_ends_no_connection_and_loses_no_batch(
    batching: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_coordinator(policy_factory=_EvilFlowRaises, batching=batching) as coord:
        victim, evil = await connect_as(coord, "victim"), await connect_as(coord, "evil")
        try:
            await victim.send(Flows(opens=(_open(1, ("victim:tx",)),)))
            await next_levels(victim)
            await evil.send(Flows(opens=(_open(7, ("evil:tx", "victim:rx")),)))
            await wait_until(lambda: coord.state.quarantined, 3.0, "the evil flow quarantined")
            # the victim's report makes evil's flow dirty too (its link): one batch
            await victim.send(
                NicLoad((NicLoadEntry("victim:rx", 1e9, 0.5),)),
            )
            await victim.send(Flows(progress_ids=(1,), progress_sent=(100,)))
            assert (await next_levels(victim)).updates[0].level == 6
            await evil.send(JobProgress("j", 1))  # still connected
            await wait_until(lambda: coord.live.frames_received >= 5, 3.0, "evil's frame")
            assert set(coord.sessions) == {"victim", "evil"} and not coord.live.rejected
        finally:
            await victim.close()
            await evil.close()
    assert "policy reevaluate raised on flow 7 of node evil" in caplog.text
    assert "ZeroDivisionError" in caplog.text


class _FaultThatPasses(BytesPolicy):
    """BytesPolicy whose reevaluate raises on node "evil"'s flows until ``failing`` is
    cleared; promotions swept (it has no next_change)."""

    failing = True

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        flows = list(flows)
        if self.failing and any(flow.node == "evil" for flow in flows):
            raise ZeroDivisionError("float division by zero")
        return super().reevaluate(flows, ctx)


class _FaultThatPassesTimed(_FaultThatPasses):
    """The same with promotion timers (none ever due)."""

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        return None


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", [_FaultThatPasses, _FaultThatPassesTimed])
async def test_a_quarantined_flow_gets_its_level_once_the_fault_passed(
    policy: type[_FaultThatPasses],
) -> None:
    async with running_coordinator(policy_factory=policy) as coord:
        assert coord.state.promotion == ("timers" if policy is _FaultThatPassesTimed else "sweep")
        evil = await connect_as(coord, "evil")
        try:
            await evil.send(Flows(opens=(_open(7, ("evil:tx",)),)))
            assert (await next_levels(evil)).updates[0].level == 7  # admitted
            await evil.send(Flows(progress_ids=(7,), progress_sent=(300,)))
            await wait_until(lambda: coord.state.quarantined, 3.0, "the evil flow quarantined")
            assert isinstance(coord.state.policy, _FaultThatPasses)
            coord.state.policy.failing = False
            # its retry comes QUARANTINE_RETRY_FIRST (1 s) after the failure
            update = (await asyncio.wait_for(next_levels(evil), 5.0)).updates[0]
            assert (update.id, update.level) == (7, 4) and not coord.state.quarantined
        finally:
            await evil.close()


# -- link series in /metrics -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_link_series_are_exported_for_connected_nodes_only() -> None:
    async with running_coordinator(grace_period=60.0) as coordinator:
        gone, here = await connect_as(coordinator, "gone"), await connect_as(coordinator, "here")
        try:
            for link, node in ((gone, "gone"), (here, "here")):
                await link.send(NicLoad((NicLoadEntry(f"{node}:tx", 1e9, 0.25),)))
            await wait_until(lambda: len(coordinator.state.link_load) == 2, 3.0, "both loads")
            await gone.close()
            await wait_until(lambda: "gone" not in coordinator.sessions, 3.0, "gone's end")
            text = await scrape(coordinator)
            assert 'link_utilization_ratio{link="here:tx"} 0.25' in text
            assert 'link="gone:tx"' not in text  # kept for its grace period, not exported
            coordinator.state.drop_node("gone", time.time())  # (what its grace period's end does)
            assert list(coordinator.state.link_load) == ["here:tx"]
        finally:
            await here.close()


# -- closing: a peer that never reads holds no socket ------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("how", "code", "within"),
    [
        ("send_overflow", "send_overflow", 0.5),
        ("replaced", "replaced", 0.5),
        ("idle", "timeout", 0.5),
        ("shutdown", "shutdown", CLOSE_TIMEOUT + 1.0),
    ],
)
async def test_a_closed_connection_lets_go_of_a_peer_that_never_reads(
    how: str, code: str, within: float
) -> None:
    limit = 1 << 20 if how == "send_overflow" else 1 << 30  # (heartbeats must not overflow)
    overrides = {"send_buffer_limit": limit, "idle_timeout": 0.5, "heartbeat_interval": 0.2}
    async with running_coordinator(**overrides) as coordinator:
        link = await connect_as(coordinator, "stuck")  # from here on it reads nothing
        try:
            await wait_until(lambda: "stuck" in coordinator.sessions, 3.0, "the session")
            connection = coordinator.sessions["stuck"]
            transport = connection._transport
            sock = transport.get_extra_info("socket")
            transport.write(b"\0" * (48 << 20))  # more than both ends' kernel buffers hold
            started = time.monotonic()
            if how == "send_overflow":
                connection.send(Levels((), 0))
            elif how in ("replaced", "shutdown"):
                connection.abort(code, "test", tell_peer=True)
            else:
                started += 0.5  # the idle timeout first
            await wait_until(lambda: sock.fileno() == -1, within + 2.0, "the socket closed")
            assert time.monotonic() - started < within + 0.5
            await wait_until(lambda: coordinator.live.rejected, 3.0, "the close counted")
            assert coordinator.live.rejected == {code: 1}
        finally:
            await link.close(timeout=0.1)


# -- unexpected exceptions, and the peer's words in the log ------------------------------------


@pytest.mark.asyncio
async def test_an_unexpected_exception_ends_the_connection_with_an_error_frame(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_coordinator() as coordinator:
        handle = coordinator.handle

        def buggy(node: str, message: Message, arrival: float) -> None:
            if isinstance(message, JobProgress):
                raise RecursionError("maximum recursion depth exceeded")
            handle(node, message, arrival)

        monkeypatch.setattr(coordinator, "handle", buggy)
        bad, good = await connect_as(coordinator, "bad"), await connect_as(coordinator, "good")
        try:
            await bad.send(JobProgress("j", 1))
            assert await _closed_with(bad) == "internal"
            assert coordinator.live.rejected == {"internal": 1}
            await good.send(Flows(opens=(_open(1, ("good:tx",)),)))
            await next_levels(good)
        finally:
            await bad.close()
            await good.close()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and errors[0].exc_info is not None
    assert "unexpected error serving" in errors[0].getMessage() and "node=bad" in caplog.text


@pytest.mark.asyncio
async def test_a_peers_error_text_cannot_forge_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="flowsched.coordinator")
    forged = "bye\n2026-12-04 15:00:00,000 INFO flowsched.coordinator: agent n1 connected"
    async with running_coordinator() as coordinator:
        assert coordinator.addresses is not None
        reader, writer = await asyncio.open_connection(
            coordinator.addresses.host, coordinator.addresses.port
        )
        conn = Connection(Role.AGENT, token=TOKEN)
        try:
            writer.write(conn.hello("n1"))
            while not isinstance(conn.next_event(), Challenge):
                conn.receive_data(await reader.read(4096))
            writer.write(conn.send_error("x\r\ny", forged + "." * 2000))
            await wait_until(lambda: coordinator.live.rejected, 3.0, "the close")
        finally:
            writer.close()
    assert coordinator.live.rejected == {"peer_error": 1}
    (line,) = [r.getMessage() for r in caplog.records if "peer_error" in r.getMessage()]
    assert "\n" not in line and "\r" not in line
    assert "'x\\r\\ny'" in line and "'bye\\n2026-12-04" in line
    assert len(line) < 1000
