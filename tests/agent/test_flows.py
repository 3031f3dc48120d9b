"""The agent's flow registry: plugin connections, SDK flows, the linking rule, batches."""

from __future__ import annotations

import dataclasses

import pytest

from flowsched import policies
from flowsched.agent.flows import (
    MAX_ENTRIES_PER_FRAME,
    MAX_OPENS_PER_FRAME,
    FlowRegistry,
    SdkFlow,
    SlotConn,
    SlotKey,
    resync_frames,
    split_batch,
)
from flowsched.coordinator.state import ClusterState
from flowsched.model import FlowClass
from flowsched.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    U64_MAX,
    FlowOpen,
    Flows,
    LocalProtocolError,
    Resync,
    decode_body,
    encode_body,
    frame,
)
from flowsched.protocol.sdk import MAX_NODE
from flowsched.shm import layout
from flowsched.shm.table import SlotSnapshot

PID = 100
_BLANK = SlotSnapshot(
    0,
    layout.SLOT_ACTIVE,
    PID,
    1,
    0,
    -1,
    -1,
    layout.LEVEL_UNSET,
    0,
    layout.DIR_SEND,
    0,
    0,
    0,
    0,
    0,
    0,
    0,
    0,
    layout.LEVEL_UNSET,
    0,
    0,
    0,
    0,
    0,
)


def slot(
    index: int,
    *,
    cls: FlowClass = FlowClass.EXPERIENCE,
    nbytes: int = 0,
    peer: int = -1,
    pid: int = PID,
    state: int = layout.SLOT_ACTIVE,
    seq: int = 1,
    direction: int = layout.DIR_SEND,
) -> SlotSnapshot:
    return dataclasses.replace(
        _BLANK,
        index=index,
        class_id=int(cls),
        bytes=nbytes,
        peer_rank=peer,
        pid=pid,
        state=state,
        claim_seq=seq,
        direction=direction,
    )


@pytest.fixture
def reg() -> FlowRegistry:
    return FlowRegistry(
        node="n1",
        links=("n1/eth0",),
        id_prefix=3,
        default_deadline=lambda c: 2.0 if c is FlowClass.KV else None,
    )


def test_plugin_connection_is_its_own_flow(reg: FlowRegistry) -> None:
    changed, ended = reg.observe([slot(0, nbytes=10)], 50.0, 0)
    assert changed == [(0, 1)] and ended == []
    batch = reg.take_batch()
    assert batch is not None and len(batch.opens) == 1
    opened = batch.opens[0]
    assert opened.cls is FlowClass.EXPERIENCE and opened.sent == 10
    assert opened.links == ("n1/eth0",) and opened.id >> 40 == 3
    reg.observe([slot(0, nbytes=25)], 51.0, 0)
    batch = reg.take_batch()
    assert batch is not None and list(batch.reports()) == [(opened.id, 25)]
    assert reg.take_batch() is None  # nothing changed
    _, ended = reg.observe([slot(0, nbytes=30, state=layout.SLOT_CLOSED)], 52.0, 0)
    assert ended == [(0, 1)]
    batch = reg.take_batch()
    assert batch is not None and [(c.id, c.sent, c.closed_at) for c in batch.closes] == [
        (opened.id, 30, 52.0)
    ]
    assert not reg.flows and not reg.slots


def test_receive_side_connections_are_not_reported(reg: FlowRegistry) -> None:
    reg.observe([slot(0, direction=layout.DIR_RECV, nbytes=5)], 1.0, 0)
    assert reg.take_batch() is None and len(reg.slots) == 1


def test_vanished_slot_counts_as_closed(reg: FlowRegistry) -> None:
    reg.observe([slot(0, nbytes=5)], 1.0, 0)
    reg.take_batch()
    reg.observe([slot(0, nbytes=8, seq=2)], 2.0, 0)  # reclaimed by another connection
    batch = reg.take_batch()
    assert batch is not None and len(batch.closes) == 1 and len(batch.opens) == 1


def test_open_and_close_within_one_batch_are_both_sent(reg: FlowRegistry) -> None:
    reg.observe([slot(0, nbytes=5)], 1.0, 0)
    reg.observe([], 1.1, 0)
    batch = reg.take_batch()
    assert batch is not None
    assert [o.id for o in batch.opens] == [c.id for c in batch.closes]


def test_linking_rule(reg: FlowRegistry) -> None:
    reg.observe(
        [
            slot(0, nbytes=100, peer=1),
            slot(1, nbytes=7, peer=2),
            slot(2, cls=FlowClass.TP, nbytes=9, peer=1),
            slot(3, nbytes=1, pid=999),
        ],
        1.0,
        0,
    )
    reg.take_batch()
    own_before = reg.slots[0, 1].flow_id
    sdk_flow, linked = reg.open_sdk(
        PID, FlowClass.EXPERIENCE, 2.0, consumer_index=4, job="j", peer=1
    )
    assert linked == [(0, 1)]  # same pid, same class, same peer only
    batch = reg.take_batch()
    assert batch is not None
    assert [c.id for c in batch.closes] == [own_before]  # its standalone flow ends
    assert [o.id for o in batch.opens] == [sdk_flow.flow_id]
    reg.observe(
        [
            slot(0, nbytes=400, peer=1),
            slot(1, nbytes=7, peer=2),
            slot(2, cls=FlowClass.TP, nbytes=9, peer=1),
            slot(3, nbytes=1, pid=999),
        ],
        3.0,
        0,
    )
    reg.sdk_progress(sdk_flow.flow_id, PID, 50)
    assert sdk_flow.sent == 50 + 300  # app bytes + plugin bytes since linking
    assert reg.set_level(sdk_flow.flow_id, 2) == [(0, 1)]
    assert reg.level_of_slot((0, 1)) == 2 and reg.level_of_slot((1, 1)) is None
    released = reg.close_sdk(sdk_flow.flow_id, PID, None, 4.0)
    assert released == [(0, 1)]
    batch = reg.take_batch()
    assert batch is not None
    assert [(c.id, c.sent) for c in batch.closes] == [(sdk_flow.flow_id, 350)]
    assert len(batch.opens) == 1 and batch.opens[0].sent == 0  # standalone again, new id
    assert batch.opens[0].id not in (own_before, sdk_flow.flow_id)


@pytest.mark.parametrize(
    ("peer", "linked"),
    [
        (None, [(0, 1), (1, 1), (2, 1)]),  # not narrowed: every send connection of the class
        (2, [(1, 1)]),  # narrowed: only the connection known to send to rank 2
        (-1, [(0, 1), (1, 1), (2, 1)]),  # "no peer": not narrowed, never "peer unknown only"
    ],
    ids=["none", "rank-2", "minus-1"],
)
def test_a_negative_peer_narrows_nothing(
    reg: FlowRegistry, peer: int | None, linked: list[tuple[int, int]]
) -> None:
    """A connection whose peer is still unknown (-1) never links to a narrowed flow
    (docs/nccl-plugin-transport.md): an SDK flow opened with peer -1 is not narrowed."""
    reg.observe([slot(0, peer=-1), slot(1, peer=2), slot(2, peer=3)], 1.0, 0)
    reg.take_batch()
    _, got = reg.open_sdk(PID, FlowClass.EXPERIENCE, 2.0, peer=peer)
    assert sorted(got) == linked
    reg.observe([slot(0, nbytes=1, peer=5), slot(1, peer=2), slot(2, peer=3)], 3.0, 0)
    assert sorted(k for k, c in reg.slots.items() if c.linked_to is not None) == linked


def test_new_connection_during_sdk_flow_is_linked(reg: FlowRegistry) -> None:
    sdk_flow, _ = reg.open_sdk(PID, FlowClass.KV, 1.0, size=1000)
    assert sdk_flow.deadline == 3.0  # class default relative deadline
    reg.observe([slot(5, cls=FlowClass.KV, nbytes=64)], 1.5, 0)
    assert sdk_flow.sent == 64 and reg.slots[5, 1].flow_id is None
    reg.observe([slot(5, cls=FlowClass.KV, nbytes=80, state=layout.SLOT_CLOSED)], 1.6, 0)
    assert sdk_flow.sent == 80  # bytes of a closed linked connection still count


@pytest.mark.parametrize(
    "client_start,slot_start,linked",
    [
        (100, 100, True),  # the client's own connection
        (100, 200, False),  # a later process given the client's pid
        (100, 0, True),  # a plugin that does not say when its process started
        (0, 200, True),  # an agent that could not tell when the client started
    ],
    ids=["same-process", "pid-reused", "slot-unknown", "client-unknown"],
)
def test_only_the_clients_own_process_is_linked_to_its_sdk_flow(
    reg: FlowRegistry, client_start: int, slot_start: int, linked: bool
) -> None:
    """A pid names a process only together with its start: the SDK client's connection may
    outlive it, and a later process given its pid is not its client."""
    sdk_flow, _ = reg.open_sdk(PID, FlowClass.KV, 1.0, start_ticks=client_start)
    snap = dataclasses.replace(slot(5, cls=FlowClass.KV), start_ticks=slot_start)
    reg.observe([snap], 1.5, 0)
    assert (reg.slots[5, 1].linked_to == sdk_flow.flow_id) is linked
    # and the other way round: a flow opened after the slot appeared
    other = FlowRegistry(node="n1", links=("n1/eth0",), id_prefix=4)
    other.observe([snap], 1.0, 0)
    _, got = other.open_sdk(PID, FlowClass.KV, 1.5, start_ticks=client_start)
    assert bool(got) is linked


@pytest.mark.parametrize(
    "flags,counted", [(0, 64), (layout.SLOT_FLAG_MOVED, 0)], ids=["new", "moved"]
)
def test_a_connection_that_moved_into_the_table_counts_from_its_arrival(
    reg: FlowRegistry, flags: int, counted: int
) -> None:
    """A connection that moved in (made before the table existed, or in a table since
    re-created) brings the bytes it carried before: they are not the SDK flow's."""
    sdk_flow, _ = reg.open_sdk(PID, FlowClass.KV, 1.0, size=1000)
    moved = dataclasses.replace(slot(5, cls=FlowClass.KV, nbytes=64), flags=flags)
    reg.observe([moved], 1.5, 0)
    assert reg.slots[5, 1].linked_to == sdk_flow.flow_id and sdk_flow.sent == counted
    reg.observe([dataclasses.replace(moved, bytes=100)], 1.6, 0)
    assert sdk_flow.sent == counted + 36


def test_a_moved_connection_that_is_its_own_flow_keeps_its_bytes(reg: FlowRegistry) -> None:
    """Without an SDK flow to carry, a moved connection is a flow of its own that opened when
    the connection did (open_ns), having sent what its slot says."""
    moved = dataclasses.replace(
        slot(0, nbytes=5000), flags=layout.SLOT_FLAG_MOVED, open_ns=1_000_000_000
    )
    reg.observe([moved], 50.0, 4_000_000_000)
    batch = reg.take_batch()
    assert batch is not None and [(o.sent, o.opened_at) for o in batch.opens] == [(5000, 47.0)]


def test_sdk_requests_of_another_pid_are_ignored(reg: FlowRegistry) -> None:
    sdk_flow, _ = reg.open_sdk(PID, FlowClass.BULK, 1.0)
    reg.sdk_progress(sdk_flow.flow_id, PID + 1, 500)
    assert reg.close_sdk(sdk_flow.flow_id, PID + 1, 9, 2.0) == []
    assert sdk_flow.sent == 0 and sdk_flow.flow_id in reg.flows
    reg.close_pid(PID, 3.0)
    assert sdk_flow.flow_id not in reg.flows


def test_resync_carries_every_flow_with_its_level(reg: FlowRegistry) -> None:
    reg.observe([slot(0, nbytes=5), slot(1, nbytes=6)], 1.0, 0)
    first = reg.slots[0, 1].flow_id
    assert first is not None
    reg.set_level(first, 4)
    opens = reg.resync_opens()
    assert sorted((o.sent, o.level) for o in opens) == [(5, 4), (6, None)]
    assert reg.take_batch() is None  # the resync replaced the pending batch


def test_opened_at_is_derived_from_the_slot_clock(reg: FlowRegistry) -> None:
    snap = dataclasses.replace(slot(0), open_ns=1_000_000_000)
    reg.observe([snap], 100.0, 3_500_000_000)
    flow = reg.flows[reg.slots[0, 1].flow_id]  # type: ignore[index]
    assert flow.opened_at == pytest.approx(97.5)


def test_progress_can_be_held_back_while_opens_and_closes_go_out(reg: FlowRegistry) -> None:
    reg.observe([slot(0, nbytes=5)], 1.0, 0)
    reg.take_batch()
    reg.observe([slot(0, nbytes=9), slot(1, nbytes=1)], 2.0, 0)
    batch = reg.take_batch(progress=False)
    assert batch is not None and len(batch.opens) == 1 and not batch.progress_ids
    batch = reg.take_batch()
    assert batch is not None and batch.progress_sent == (9,)


def test_torn_scan_entries_are_resolved_by_a_consistent_reread(reg: FlowRegistry) -> None:
    reg.observe([slot(0, nbytes=50)], 1.0, 0)
    reg.take_batch()
    # the strided read saw the old claim's state with a new claim_seq: re-read says "seq 2"
    fresh = slot(0, nbytes=3, seq=2)
    entry = (0, layout.SLOT_ACTIVE, 2, 999)
    changed, _ = reg.observe_counts([entry], {0: fresh}.get, 2.0, 0)
    assert changed == [(0, 2)] and (0, 1) not in reg.slots
    assert reg.flows[reg.slots[0, 2].flow_id].sent == 3  # type: ignore[index]
    # a byte count lower than known (torn) is ignored
    reg.observe_counts([(0, layout.SLOT_ACTIVE, 2, 1)], {0: fresh}.get, 3.0, 0)
    assert reg.slots[0, 2].bytes == 3


@pytest.mark.parametrize(
    ("dst_node", "links"),
    [
        pytest.param(None, ("n1/eth0",), id="no-destination"),
        pytest.param("n1", ("n1/eth0",), id="own-node"),
        pytest.param("h2", ("n1/eth0", "h2:rx"), id="remote-ingress"),
    ],
)
def test_sdk_flow_links_include_the_destination(
    reg: FlowRegistry, dst_node: str | None, links: tuple[str, ...]
) -> None:
    flow, _ = reg.open_sdk(1, FlowClass.KV, 5.0, size=10, dst_node=dst_node)
    assert flow.links == links
    batch = reg.take_batch()
    assert batch is not None and batch.opens[0].links == links


def test_custom_destination_links(reg: FlowRegistry) -> None:
    custom = FlowRegistry(node="a", links=("a:tx",), id_prefix=1, links_to=lambda d: (d,))
    flow, _ = custom.open_sdk(1, FlowClass.KV, 5.0, dst_node="b")
    assert flow.links == ("b",)


def test_sdk_flow_bytes_are_capped_at_the_protocol_counter(reg: FlowRegistry) -> None:
    # the application may report U64_MAX itself; the slots it carries add more
    reg.observe([slot(0, nbytes=1000)], 1.0, 0)
    flow, linked = reg.open_sdk(PID, FlowClass.EXPERIENCE, 2.0)
    assert linked == [(0, 1)]
    reg.sdk_progress(flow.flow_id, PID, U64_MAX)
    reg.observe([slot(0, nbytes=1500)], 3.0, 0)
    assert flow.sent == U64_MAX
    batch = reg.take_batch()
    assert batch is not None
    encode_body(batch)  # raised OverflowError in msgpack, which killed the uplink
    encode_body(Resync(reg.resync_opens()))


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param([(0, 50), (1, 70), (0, 90), (1, 70), (0, 200)], id="two-slots-grow"),
        pytest.param([(0, 10), (2, 5), (0, 10), (1, 400)], id="unchanged-and-torn-reads"),
    ],
)
def test_sdk_flow_bytes_added_per_slot_match_a_full_sum(
    reg: FlowRegistry, steps: list[tuple[int, int]]
) -> None:
    counts = {0: 5, 1: 7, 2: 3}
    reg.observe([slot(i, nbytes=n) for i, n in counts.items()], 1.0, 0)
    flow, _ = reg.open_sdk(PID, FlowClass.EXPERIENCE, 2.0)
    reg.sdk_progress(flow.flow_id, PID, 11)
    for index, nbytes in steps:
        counts[index] = nbytes
        reg.observe([slot(i, nbytes=n) for i, n in counts.items()], 3.0, 0)
        live = sum(c.bytes - c.base for c in reg.slots.values() if c.linked_to == flow.flow_id)
        assert flow.sent == 11 + live
    reg.observe([slot(i, nbytes=n) for i, n in counts.items() if i != 1], 4.0, 0)  # 1 ends
    live = sum(c.bytes - c.base for c in reg.slots.values() if c.linked_to == flow.flow_id)
    assert flow.sent == 11 + live + reg.sdk[flow.flow_id].slot_bytes_done


def test_set_level_of_a_plugin_flow_names_its_slot(reg: FlowRegistry) -> None:
    reg.observe([slot(i, nbytes=1) for i in range(64)], 1.0, 0)
    for key, conn in list(reg.slots.items()):
        assert conn.flow_id is not None
        assert reg.set_level(conn.flow_id, 3) == [key]
        assert reg.set_level(conn.flow_id, 3) == []  # unchanged: nothing to rewrite
    own = reg.slots[5, 1].flow_id
    assert own is not None
    reg.open_sdk(PID, FlowClass.EXPERIENCE, 2.0)  # links every slot: their own flows close
    assert reg.set_level(own, 1) == []
    sdk_id = next(iter(reg.sdk))
    released = reg.close_sdk(sdk_id, PID, None, 3.0)
    again = reg.slots[5, 1].flow_id
    assert len(released) == 64 and again is not None and again != own
    assert reg.set_level(again, 2) == [(5, 1)]


def _big_registry(count: int) -> FlowRegistry:
    reg = FlowRegistry(node="n" * MAX_NODE, links=("n" * MAX_NODE + ":tx",), id_prefix=1)
    for i in range(count):
        reg.open_sdk(
            PID, FlowClass.KV, 1.0, size=10**9, deadline=4e9, job=f"{i:07d}" + "é" * 248,
            request=f"{i:07d}" + "€" * 248, dst_node="d" * MAX_NODE,
        )  # fmt: skip
        reg.set_level(max(reg.flows), i % 8)
    return reg


def test_a_resync_larger_than_one_frame_is_split_and_rebuilds_the_coordinator_state() -> None:
    reg = _big_registry(1500)
    frames = resync_frames(reg.resync_opens())
    assert len(frames) > 1 and isinstance(frames[0], Resync)
    for message in frames:  # each frame fits the default limit (a Resync of all did not)
        frame(encode_body(message), DEFAULT_MAX_FRAME_SIZE)
    with pytest.raises(LocalProtocolError):
        frame(encode_body(Resync(reg.resync_opens())), DEFAULT_MAX_FRAME_SIZE)
    state = ClusterState(policies.create("fair", {}, num_levels=8))
    state.open_flows(reg.node, (_stale_open(), *frames[0].opens, *frames[-1].opens), 0.5)
    known = dict(state.by_node[reg.node])  # flows of the previous connection, one stale
    for message in frames:
        if isinstance(message, Resync):
            state.resync(reg.node, message.opens, 2.0)
        else:
            assert not (message.progress_ids or message.closes)
            state.continue_resync(reg.node, message.opens, 2.0)
    state.end_resync(reg.node, 2.5)  # the agent's next frame came
    assert set(state.by_node[reg.node]) == set(reg.flows)  # the stale flow is gone
    for wire_id in (op.id for op in (*frames[0].opens, *frames[-1].opens)):
        assert state.by_node[reg.node][wire_id] == known[wire_id]  # the same flow, kept


def _stale_open() -> FlowOpen:
    return FlowOpen(id=1, cls=FlowClass.KV, opened_at=0.0, sent=0)


def test_a_large_batch_is_split_with_every_open_before_any_close(reg: FlowRegistry) -> None:
    reg.observe([slot(i, nbytes=1) for i in range(3)], 1.0, 0)
    reg.take_batch()
    for i in range(MAX_OPENS_PER_FRAME * 2 + 5):
        flow, _ = reg.open_sdk(PID + 1, FlowClass.KV, 2.0)
        if i % 2:
            reg.close_sdk(flow.flow_id, PID + 1, 5, 2.5)
    reg.observe([slot(i, nbytes=9) for i in range(3)], 3.0, 0)
    batch = reg.take_batch()
    assert batch is not None
    frames = split_batch(batch)
    assert len(frames) > 2
    assert [o for f in frames for o in f.opens] == list(batch.opens)
    assert [c for f in frames for c in f.closes] == list(batch.closes)
    assert [p for f in frames for p in f.reports()] == list(batch.reports())
    last_open = max(i for i, f in enumerate(frames) if f.opens)
    assert all(not f.closes and not f.progress_ids for f in frames[: last_open + 1])
    assert split_batch(frames[-1]) == [frames[-1]]  # a small batch stays one frame


@pytest.mark.parametrize("version", [1, 2], ids=["maps", "packed"])
def test_progress_beyond_one_frame_goes_out_in_frames_the_coordinator_accepts(
    version: int,
) -> None:
    count = MAX_ENTRIES_PER_FRAME * 2 + 1
    batch = Flows(progress_ids=tuple(range(count)), progress_sent=tuple(range(1, count + 1)))
    frames = split_batch(batch)
    assert [len(f.progress_ids) for f in frames] == [MAX_ENTRIES_PER_FRAME] * 2 + [1]
    assert [p for f in frames for p in f.reports()] == list(batch.reports())
    for part in frames:  # each within the coordinator's bound on reports per frame
        body = encode_body(part, version)
        frame(body, DEFAULT_MAX_FRAME_SIZE)
        assert decode_body(body) == part


# ---------------------------------------------------------------- peers learned late (#1)


def test_a_send_connection_links_to_a_peer_narrowed_flow_once_its_peer_is_known(
    reg: FlowRegistry,
) -> None:
    """The plugin claims a send slot with peer -1 and fills the peer in later (the
    receiver's rank note): the connection links as soon as the slot names the flow's peer."""
    reg.observe([slot(0, nbytes=10)], 1.0, 0)  # peer -1 at claim, as the plugin does
    sdk_flow, linked = reg.open_sdk(PID, FlowClass.EXPERIENCE, 2.0, peer=7)
    assert linked == [] and reg.slots[0, 1].linked_to is None  # destination not known yet
    changed, _ = reg.observe([slot(0, nbytes=30, peer=7)], 3.0, 0)  # the rank note arrived
    assert changed == [(0, 1)]  # its level must be rewritten
    assert reg.slots[0, 1].peer_rank == 7 and reg.slots[0, 1].linked_to == sdk_flow.flow_id
    reg.observe([slot(0, nbytes=100, peer=7)], 4.0, 0)
    assert sdk_flow.sent == 90  # bytes seen from the scan that linked it on (10 were its own)
    assert reg.set_level(sdk_flow.flow_id, 1) == [(0, 1)]


@pytest.mark.parametrize(
    ("learned", "sdk_peer", "direction", "linked"),
    [
        pytest.param(7, 7, layout.DIR_SEND, True, id="peer-matches"),
        pytest.param(8, 7, layout.DIR_SEND, False, id="another-peer"),
        pytest.param(-1, 7, layout.DIR_SEND, False, id="still-unknown"),
        pytest.param(7, 7, layout.DIR_RECV, False, id="receive-never-linked"),
    ],
)
def test_which_connections_a_peer_narrowed_flow_links(
    reg: FlowRegistry, learned: int, sdk_peer: int, direction: int, linked: bool
) -> None:
    reg.observe([slot(0, direction=direction)], 1.0, 0)
    sdk_flow, _ = reg.open_sdk(PID, FlowClass.EXPERIENCE, 2.0, peer=sdk_peer)
    reg.observe([slot(0, direction=direction, peer=learned, nbytes=5)], 3.0, 0)
    assert (reg.slots[0, 1].linked_to == sdk_flow.flow_id) is linked


def test_a_peer_is_re_read_only_while_a_flow_of_its_process_narrows_by_peer(
    reg: FlowRegistry,
) -> None:
    reg.observe([slot(0), slot(1, pid=PID + 1)], 1.0, 0)
    reg.open_sdk(PID, FlowClass.EXPERIENCE, 2.0, peer=3)
    fetched: list[int] = []

    def fetch(index: int) -> SlotSnapshot:
        fetched.append(index)
        return slot(index, pid=PID if index == 0 else PID + 1)

    reg.observe_counts(
        [(0, layout.SLOT_ACTIVE, 1, 0), (1, layout.SLOT_ACTIVE, 1, 0)], fetch, 3.0, 0
    )
    assert fetched == [0]  # the other process has no narrowed flow: nothing to learn


# ---------------------------------------------------------------- overlapping SDK flows (#2)


def test_closing_one_of_two_overlapping_flows_hands_its_connections_to_the_other(
    reg: FlowRegistry,
) -> None:
    reg.observe([slot(0, cls=FlowClass.PARAM_SYNC, nbytes=0)], 1.0, 0)
    first, linked = reg.open_sdk(PID, FlowClass.PARAM_SYNC, 2.0, deadline=100.0)
    second, _ = reg.open_sdk(PID, FlowClass.PARAM_SYNC, 2.5, deadline=10.0)
    assert linked == [(0, 1)] and reg.slots[0, 1].linked_to == first.flow_id  # the oldest
    reg.observe([slot(0, cls=FlowClass.PARAM_SYNC, nbytes=1000)], 3.0, 0)
    assert reg.close_sdk(first.flow_id, PID, None, 4.0) == [(0, 1)]
    assert first.sent == 1000
    assert reg.slots[0, 1].linked_to == second.flow_id  # not a standalone flow
    assert reg.slots[0, 1].flow_id is None
    reg.observe([slot(0, cls=FlowClass.PARAM_SYNC, nbytes=6000)], 5.0, 0)
    assert second.sent == 5000  # the NCCL bytes now count for the open flow
    assert reg.level_of_slot((0, 1)) is None  # the second flow's level is not decided yet
    reg.set_level(second.flow_id, 2)
    assert reg.level_of_slot((0, 1)) == 2
    assert list(reg.flows) == [second.flow_id]  # no standalone flow was opened for it


@pytest.mark.parametrize(
    ("others", "carrier"),
    [
        pytest.param([], None, id="none-open: standalone"),
        pytest.param([(PID, FlowClass.PARAM_SYNC, None)], 0, id="one-open"),
        pytest.param(
            [(PID, FlowClass.PARAM_SYNC, None), (PID, FlowClass.PARAM_SYNC, None)],
            0,
            id="several: the oldest",
        ),
        pytest.param([(PID + 1, FlowClass.PARAM_SYNC, None)], None, id="another-pid"),
        pytest.param([(PID, FlowClass.KV, None)], None, id="another-class"),
        pytest.param(
            [(PID, FlowClass.PARAM_SYNC, 9), (PID, FlowClass.PARAM_SYNC, 4)],
            1,
            id="narrowed: the oldest that matches its peer",
        ),
    ],
)
def test_the_flow_a_released_connection_carries_next(
    reg: FlowRegistry, others: list[tuple[int, FlowClass, int | None]], carrier: int | None
) -> None:
    reg.observe([slot(0, cls=FlowClass.PARAM_SYNC, peer=4)], 1.0, 0)
    closing, _ = reg.open_sdk(PID, FlowClass.PARAM_SYNC, 2.0)
    opened = [reg.open_sdk(pid, cls, 3.0, peer=peer)[0] for pid, cls, peer in others]
    assert reg.close_sdk(closing.flow_id, PID, None, 4.0) == [(0, 1)]
    conn = reg.slots[0, 1]
    if carrier is None:
        assert conn.linked_to is None and conn.flow_id is not None
    else:
        assert conn.linked_to == opened[carrier].flow_id and conn.flow_id is None


class LookupCountingDict(dict[int, SdkFlow]):
    """The registry's SDK flows, counting how often one is looked up: the work a close does."""

    lookups = 0

    def __getitem__(self, key: int) -> SdkFlow:
        self.lookups += 1
        return super().__getitem__(key)


@pytest.mark.parametrize(
    ("pid", "cls", "peer"),
    [
        pytest.param(PID, FlowClass.KV, None, id="another-class"),
        pytest.param(PID, FlowClass.PARAM_SYNC, 9, id="narrowed-to-another-peer"),
        pytest.param(PID + 1, FlowClass.PARAM_SYNC, None, id="another-process"),
    ],
)
def test_a_released_connection_looks_only_at_the_flows_it_could_carry(
    reg: FlowRegistry, pid: int, cls: FlowClass, peer: int | None
) -> None:
    """Each connection a closed SDK flow released looked at every open SDK flow of the node
    for its next carrier: a user with 4,096 flows of another class open, closing one that
    carried 64 NCCL connections, held the agent's loop for 64 ms per close (every user's
    opens and the coordinator link waited)."""
    connections, others = 8, 64
    reg.observe([slot(i, cls=FlowClass.PARAM_SYNC, peer=4) for i in range(connections)], 1.0, 0)
    for _ in range(others):  # none of them can carry those connections
        reg.open_sdk(pid, cls, 2.0, peer=peer)
    closing, linked = reg.open_sdk(PID, FlowClass.PARAM_SYNC, 3.0)
    assert len(linked) == connections
    reg.sdk = counting = LookupCountingDict(reg.sdk)
    assert len(reg.close_sdk(closing.flow_id, PID, None, 4.0)) == connections
    assert all(reg.slots[i, 1].flow_id is not None for i in range(connections))  # standalone
    assert counting.lookups <= 4 * connections, f"{counting.lookups} lookups"


class SlotLookupCountingDict(dict[SlotKey, SlotConn]):
    """The registry's connections, counting how often one is looked up."""

    lookups = 0

    def __getitem__(self, key: SlotKey) -> SlotConn:
        self.lookups += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("how", ["open", "handover"])
def test_linking_many_connections_at_once_costs_one_look_at_each(
    reg: FlowRegistry, how: str
) -> None:
    """Each connection linked to an SDK flow re-summed the bytes of every connection linked
    before it: an open (or a close handing them over) linking 1,000 connections of a process
    cost 64-85 ms of the agent's loop, each time the client opened its flow again."""
    connections = 64
    reg.observe([slot(i, cls=FlowClass.KV, nbytes=10 * i) for i in range(connections)], 1.0, 0)
    first = reg.open_sdk(PID, FlowClass.KV, 2.0)[0] if how == "handover" else None
    reg.slots = counting = SlotLookupCountingDict(reg.slots)
    flow, linked = reg.open_sdk(PID, FlowClass.KV, 3.0)
    if first is not None:
        assert reg.close_sdk(first.flow_id, PID, None, 4.0) == sorted(reg.slots)
    else:
        assert sorted(linked) == sorted(reg.slots)
    assert all(conn.linked_to == flow.flow_id for conn in reg.slots.values())
    assert counting.lookups <= 4 * connections, f"{counting.lookups} lookups"
    reg.observe([slot(i, cls=FlowClass.KV, nbytes=10 * i + 5) for i in range(connections)], 5, 0)
    assert flow.sent == 5 * connections  # the bytes since linking, as a full sum counts them
