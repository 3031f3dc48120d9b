"""The agent's flow registry: plugin connections, SDK flows, the linking rule, batches."""

from __future__ import annotations

import dataclasses

import pytest

from flowsched.agent.flows import FlowRegistry
from flowsched.model import FlowClass
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
    layout.LEVEL_UNSET,
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
    assert batch is not None and [(p.id, p.sent) for p in batch.progress] == [(opened.id, 25)]
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


def test_new_connection_during_sdk_flow_is_linked(reg: FlowRegistry) -> None:
    sdk_flow, _ = reg.open_sdk(PID, FlowClass.KV, 1.0, size=1000)
    assert sdk_flow.deadline == 3.0  # class default relative deadline
    reg.observe([slot(5, cls=FlowClass.KV, nbytes=64)], 1.5, 0)
    assert sdk_flow.sent == 64 and reg.slots[5, 1].flow_id is None
    reg.observe([slot(5, cls=FlowClass.KV, nbytes=80, state=layout.SLOT_CLOSED)], 1.6, 0)
    assert sdk_flow.sent == 80  # bytes of a closed linked connection still count


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
    assert batch is not None and len(batch.opens) == 1 and not batch.progress
    batch = reg.take_batch()
    assert batch is not None and [p.sent for p in batch.progress] == [9]


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
