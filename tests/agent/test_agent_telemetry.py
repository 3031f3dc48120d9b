"""SlotTelemetry: bytes sent per class and level, and the level-apply latency histogram, read
from a real flow table driven by the plugin's emulation."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import Histogram

from flowsched.agent.flows import SlotConn
from flowsched.agent.telemetry import SlotTelemetry, Telemetry
from flowsched.model import SLACK_CAP, Flow, FlowClass
from flowsched.shm import layout
from flowsched.shm.table import EmulatedPluginSlot, FlowTable


def _count(hist: Histogram) -> float:
    (family,) = hist.collect()
    return next(s.value for s in family.samples if s.name.endswith("_count"))


def _sum(hist: Histogram) -> float:
    (family,) = hist.collect()
    return next(s.value for s in family.samples if s.name.endswith("_sum"))


class _Node:
    """A table, the plugin slots on it and the connections the agent knows."""

    def __init__(self, tmp_path: Path) -> None:
        self.table, _ = FlowTable.create_or_attach(str(tmp_path / "table"), num_slots=16)
        self.conns: dict[tuple[int, int], SlotConn] = {}
        self.telemetry = SlotTelemetry()

    def connect(
        self, cls: FlowClass, direction: int = layout.DIR_SEND, moved: bool = False
    ) -> EmulatedPluginSlot:
        slot = EmulatedPluginSlot(self.table, class_id=int(cls), direction=direction)
        key = (slot.index, slot.claim_seq)
        self.conns[key] = SlotConn(key, 1, cls, -1, direction, 0, 0, moved=moved)
        return slot

    def scan(self) -> None:
        columns = {name: self.table.slot_column(name) for name in SlotTelemetry.COLUMNS}
        self.telemetry.scan(self.table.busy_slots(), columns, self.conns)


def test_bytes_count_for_the_level_applied_and_each_write_is_timed_once(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    tp = node.connect(FlowClass.TP)
    tp.send(7000)
    node.scan()  # the first scan is a baseline: bytes from before the agent are not counted
    assert node.telemetry.sent == {}
    node.table.set_level(tp.index, 3)
    tp.send(1000)  # the plugin applies level 3 at this message
    node.scan()
    assert node.telemetry.sent == {("tp", "3"): 1000}
    assert _count(node.telemetry.apply_latency) == 1
    tp.send(10)  # same level: bytes counted, no new latency sample
    node.scan()
    assert _count(node.telemetry.apply_latency) == 1
    node.table.set_level(tp.index, 1)
    node.scan()  # written, not yet applied (no message since)
    assert _count(node.telemetry.apply_latency) == 1
    tp.send(500)
    node.scan()
    assert node.telemetry.sent == {("tp", "3"): 1010, ("tp", "1"): 500}
    assert _count(node.telemetry.apply_latency) == 2
    assert 0 <= _sum(node.telemetry.apply_latency) < 5.0


def test_receives_and_unknown_connections_are_not_counted(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    node.scan()
    rx = node.connect(FlowClass.KV, direction=layout.DIR_RECV)
    stranger = EmulatedPluginSlot(node.table, class_id=int(FlowClass.BULK))
    rx.send(100)
    stranger.send(100)
    node.scan()
    assert node.telemetry.sent == {}


def test_a_connection_opened_after_the_baseline_counts_from_zero(tmp_path: Path) -> None:
    node = _Node(tmp_path)
    node.scan()
    kv = node.connect(FlowClass.KV)
    kv.send(300)  # no level written: the class default, applied by the plugin
    node.scan()
    default = node.table.read_config().default_level(int(FlowClass.KV))
    assert node.telemetry.sent == {("kv", str(default)): 300}
    assert _count(node.telemetry.apply_latency) == 0  # a default is not an agent write


def test_a_connection_that_moved_in_after_the_baseline_counts_from_its_arrival(
    tmp_path: Path,
) -> None:
    """A connection that moved into the table already open (a job that started before this
    agent) brings what it sent before: not this agent's to count."""
    node = _Node(tmp_path)
    node.scan()
    moved = node.connect(FlowClass.BULK, moved=True)
    moved.send(10_000_000_000)  # its history, in the slot when the agent first sees it
    node.scan()
    assert node.telemetry.sent == {}
    moved.send(700)
    node.scan()
    default = node.table.read_config().default_level(int(FlowClass.BULK))
    assert node.telemetry.sent == {("bulk", str(default)): 700}


@pytest.mark.parametrize(
    ("applied", "label"),
    [
        pytest.param(0, "0", id="first-level"),
        pytest.param(layout.MAX_LEVELS - 1, str(layout.MAX_LEVELS - 1), id="last-level"),
        pytest.param(layout.MAX_LEVELS, "invalid", id="one-past-the-levels"),
        pytest.param(1000, "invalid", id="tampered"),
        pytest.param(layout.LEVEL_UNSET - 1, "invalid", id="u32-max-minus-one"),
        pytest.param(layout.LEVEL_UNSET, "unset", id="unset"),
    ],
)
def test_applied_levels_outside_the_level_range_share_one_label(
    tmp_path: Path, applied: int, label: str
) -> None:
    """A table writer choosing its own applied_level words cannot grow the series."""
    node = _Node(tmp_path)
    node.scan()
    tp = node.connect(FlowClass.TP)
    tp.send(100)
    off = layout.slot_offset(tp.index) + layout.SLOT_OFFSET["applied_level"]
    node.table._u32[off // 4] = applied
    node.scan()
    assert node.telemetry.sent == {("tp", label): 100}


def test_closed_flows_split_into_met_missed_lateness_and_earliness() -> None:
    telemetry = Telemetry()
    for deadline in (None, 10.0, 12.5, 8.0):
        flow = Flow(flow_id=1, cls=FlowClass.KV, opened_at=0.0, deadline=deadline)
        telemetry.completed(flow, now=10.0)
    assert telemetry.completions == {("kv", "none"): 1, ("kv", "met"): 2, ("kv", "missed"): 1}
    assert (_count(telemetry.earliness), _sum(telemetry.earliness)) == (2, 2.5)
    assert (_count(telemetry.lateness), _sum(telemetry.lateness)) == (1, 2.0)


def test_a_far_deadline_adds_at_most_the_cap_to_the_sums() -> None:
    """A deadline is any finite time an SDK client names: two at 1e308 must not pin the
    earliness sum at +Inf, and later flows must still move it."""
    telemetry = Telemetry()
    for deadline in (1.7e308, 1.7e308, 10.5, -1.7e308):
        telemetry.completed(
            Flow(flow_id=1, cls=FlowClass.KV, opened_at=0.0, deadline=deadline), 10.0
        )
    assert _sum(telemetry.earliness) == 2 * SLACK_CAP + 0.5
    assert _sum(telemetry.lateness) == SLACK_CAP
