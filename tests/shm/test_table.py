"""Tests of flowsched.shm.table: round trip, corruption, permissions, claim/close sequences."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowsched.shm import layout as L
from flowsched.shm import table as table_module
from flowsched.shm.table import (
    EmulatedPluginSlot,
    FlowTable,
    LevelMarking,
    TableConfig,
    TableError,
    default_markings,
)

CONFIG = TableConfig(
    num_levels=4,
    markings=(
        LevelMarking(46, 6),
        LevelMarking(34, 5),
        LevelMarking(10, 0x10010),
        LevelMarking(0, 0),
    ),
    class_map=((7, 2), (-5, 3), (2**31 - 1, 5)),
    fallback_class=1,
    default_levels=(0, 3, 2, 2, 1, 3),
)


@pytest.fixture
def table_path(tmp_path: Path) -> str:
    return str(tmp_path / "table")


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(child.stdout)


def test_slot_struct_matches_layout_fields(table_path: str) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=2)
    with table:
        slot = EmulatedPluginSlot(table, class_id=3, traffic_class=9, comm_id=77, peer_rank=4)
        slot.send(1234)
        raw = bytes(table._mm[L.slot_offset(slot.index) : L.slot_offset(slot.index + 1)])
        snap = table.slot(slot.index)
        assert snap is not None
        for name, offset, fmt in L.SLOT_FIELDS:
            assert getattr(snap, name) == struct.unpack_from(fmt, raw, offset)[0], name


def test_create_round_trips_config_and_header(table_path: str) -> None:
    table, info = FlowTable.create_or_attach(table_path, num_slots=16, agent_pid=4242)
    with table:
        assert info.created and info.generation == 1
        table.write_config(CONFIG)
        got = table.read_config()
        header = table.header()
    assert got.class_map == CONFIG.class_map
    assert got.markings == CONFIG.markings
    assert got.fallback_class == 1
    assert got.default_levels[:6] == CONFIG.default_levels
    assert all(level == 3 for level in got.default_levels[6:])
    assert header["magic"] == L.MAGIC and header["num_slots"] == 16
    assert header["agent_pid"] == 4242 and header["num_levels"] == 4
    assert header["config_seq"] % 2 == 0 and header["config_seq"] > 0
    assert os.path.getsize(table_path) == L.table_size(16)


def test_write_config_holds_the_seqlock_only_for_the_copy(
    table_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config area is packed before config_seq turns odd: a plugin that opens a
    connection meanwhile must not find the seqlock busy for the (slow) packing."""
    seq_while_packing: list[int] = []
    pack = table_module._pack_config

    def spy(cfg: TableConfig) -> bytes:
        seq_while_packing.append(table.header()["config_seq"])
        return pack(cfg)

    monkeypatch.setattr(table_module, "_pack_config", spy)
    table, _ = FlowTable.create_or_attach(table_path, num_slots=2)
    with table:
        for _ in range(3):
            table.write_config(CONFIG)
        assert seq_while_packing == [0, 2, 4]  # even: stable while packing
        assert table.header()["config_seq"] == 6
        assert table.read_config().markings == CONFIG.markings


def test_reattach_keeps_slots_and_bumps_generation(table_path: str) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=8)
    table.write_config(CONFIG)
    slot = EmulatedPluginSlot(table, class_id=2)
    slot.send(500)
    table.set_level(slot.index, 1)
    table.close()
    again, info = FlowTable.create_or_attach(table_path, num_slots=64)
    with again:
        assert not info.created and info.generation == 2
        assert info.kept_slots == [slot.index]
        assert again.num_slots == 8  # the existing table's size wins
        snap = again.slot(slot.index)
        assert snap is not None and snap.bytes == 500 and snap.level == 1
        assert again.read_config().class_map == CONFIG.class_map


def test_level_write_is_seen_by_plugin_and_defaults_apply(table_path: str) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=4)
    with table:
        table.write_config(CONFIG)
        slot = EmulatedPluginSlot(table, class_id=4)
        assert slot.send(10) == 1  # default level of class 4
        table.set_level(slot.index, 0)
        assert slot.send(10) == 0
        snap = table.slot(slot.index)
        assert snap is not None and snap.applied_level == 0 and snap.level_set_ns > 0
        with pytest.raises(ValueError, match="level 99"):
            table.set_level(slot.index, 99)


def test_close_release_and_reuse(table_path: str) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=1)
    with table:
        first = EmulatedPluginSlot(table)
        with pytest.raises(TableError, match="no free slot"):
            EmulatedPluginSlot(table)
        first.close()
        assert not table.release_slot(first.index, first.claim_seq + 1)  # wrong connection
        assert table.release_slot(first.index, first.claim_seq)
        second = EmulatedPluginSlot(table)
        assert second.index == first.index and second.claim_seq == first.claim_seq + 1


def test_reap_dead_frees_slots_of_exited_processes(table_path: str, dead_pid: int) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=4)
    with table:
        alive = EmulatedPluginSlot(table)
        dead = EmulatedPluginSlot(table, pid=dead_pid)
        dead.send(77)
        reaped = table.reap_dead()
        assert [(s.index, s.bytes) for s in reaped] == [(dead.index, 77)]
        assert table.slot_state(dead.index) == L.SLOT_FREE
        assert table.slot_state(alive.index) == L.SLOT_ACTIVE


def test_a_fresh_claim_showing_the_previous_owners_pid_is_not_reaped(
    table_path: str, dead_pid: int
) -> None:
    """Between its claim and its pid store, a plugin's slot still names the previous (dead)
    owner: a CLAIMED slot is reaped only if it sat unchanged since the previous pass."""
    table, _ = FlowTable.create_or_attach(table_path, num_slots=2)
    with table:
        off = L.slot_offset(0)
        table._u32[off // 4] = L.SLOT_CLAIMED  # what the plugin's CAS does
        table._u32[off // 4 + 1] = dead_pid  # the previous owner's pid, not yet overwritten
        assert table.reap_dead() == []
        assert table.slot_state(0) == L.SLOT_CLAIMED
        table._u64[off // 8 + 1] += 1  # claimed again in between: a new claim, wait again
        assert table.reap_dead() == []
        reaped = table.reap_dead()  # unchanged since the last pass: its claimer died
        assert [s.index for s in reaped] == [0] and table.slot_state(0) == L.SLOT_FREE


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        pytest.param(lambda b: b.__setitem__(slice(0, 4), b"XXXX"), "magic", id="bad-magic"),
        pytest.param(
            lambda b: b.__setitem__(slice(4, 8), struct.pack("<I", 9)),
            "version is 9",
            id="bad-version",
        ),
        pytest.param(
            lambda b: b.__setitem__(slice(12, 16), struct.pack("<I", 64)),
            "slot_size is 64",
            id="bad-slot-size",
        ),
        pytest.param(
            lambda b: b.__setitem__(slice(16, 20), struct.pack("<I", 3)),
            "does not match the file size",
            id="bad-num-slots",
        ),
    ],
)
def test_corrupt_header_is_a_clear_error(table_path: str, damage, message: str) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=2)
    table.close()
    data = bytearray(Path(table_path).read_bytes())
    damage(data)
    Path(table_path).write_bytes(bytes(data))
    with pytest.raises(TableError, match=message):
        FlowTable.open(table_path)
    with pytest.raises(TableError, match=message):
        FlowTable.create_or_attach(table_path)


def test_truncated_file_is_a_clear_error(table_path: str) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=2)
    table.close()
    os.truncate(table_path, L.HEADER_SIZE + 100)
    with pytest.raises(TableError, match="truncated or corrupt"):
        FlowTable.create_or_attach(table_path)


def test_empty_file_is_initialized(table_path: str) -> None:
    Path(table_path).touch(mode=0o600)
    table, info = FlowTable.create_or_attach(table_path, num_slots=2)
    with table:
        assert info.created and table.num_slots == 2


def test_created_file_is_private(table_path: str) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=2)
    table.close()
    assert stat.S_IMODE(os.stat(table_path).st_mode) == 0o600


def test_loose_mode_is_tightened(table_path: str) -> None:
    FlowTable.create_or_attach(table_path, num_slots=2)[0].close()
    os.chmod(table_path, 0o666)
    FlowTable.create_or_attach(table_path)[0].close()
    assert stat.S_IMODE(os.stat(table_path).st_mode) == 0o600


def test_group_mode_is_0660(table_path: str) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=2, group=os.getegid())
    table.close()
    st_ = os.stat(table_path)
    assert stat.S_IMODE(st_.st_mode) == 0o660 and st_.st_gid == os.getegid()


def test_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    link = tmp_path / "table"
    link.symlink_to(target)
    with pytest.raises(TableError, match="symbolic link"):
        FlowTable.create_or_attach(str(link))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a file of another user")
def test_file_of_another_user_is_refused(table_path: str) -> None:
    Path(table_path).write_bytes(b"")
    os.chown(table_path, 65534, 65534)
    with pytest.raises(TableError, match="owned by uid 65534"):
        FlowTable.create_or_attach(table_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"num_levels": 0, "markings": ()}, "num_levels 0", id="zero-levels"),
        pytest.param(
            {"num_levels": 2, "markings": default_markings(3)}, "markings has 3", id="marking-count"
        ),
        pytest.param(
            {"num_levels": 1, "markings": (LevelMarking(64, 0),)},
            "markings\\[0\\]",
            id="dscp-range",
        ),
        pytest.param(
            {"num_levels": 1, "markings": default_markings(1), "default_levels": (1,)},
            "default_levels\\[0\\]",
            id="default-level-range",
        ),
        pytest.param(
            {"num_levels": 1, "markings": default_markings(1), "class_map": ((0, 0),) * 33},
            "class_map has 33",
            id="map-too-long",
        ),
    ],
)
def test_invalid_config_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TableConfig(**kwargs)  # type: ignore[arg-type]


# Operations: ("claim", class_id), ("send", which, n), ("close", which), ("release", which)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), st.integers(0, 5)),
        st.tuples(st.just("send"), st.integers(0, 7), st.integers(0, 10_000)),
        st.tuples(st.just("close"), st.integers(0, 7)),
        st.tuples(st.just("release"), st.integers(0, 7)),
        st.tuples(st.just("reattach")),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=_ops)
def test_claim_close_sequences_keep_the_table_consistent(tmp_path_factory, ops) -> None:
    path = str(tmp_path_factory.mktemp("t") / "table")
    table, _ = FlowTable.create_or_attach(path, num_slots=4)
    model: dict[tuple[int, int], dict[str, int]] = {}  # key -> {"bytes", "state"}
    live: list[EmulatedPluginSlot] = []
    try:
        for op in ops:
            table = _apply(op, table, path, live, model)
            _check(table, model)
    finally:
        table.close()


def _apply(op, table, path, live, model):
    kind = op[0]
    if kind == "claim":
        free = sum(table.slot_state(i) == L.SLOT_FREE for i in range(table.num_slots))
        if not free:
            with pytest.raises(TableError):
                EmulatedPluginSlot(table, class_id=op[1])
            return table
        slot = EmulatedPluginSlot(table, class_id=op[1])
        assert (slot.index, slot.claim_seq) not in model
        live.append(slot)
        model[(slot.index, slot.claim_seq)] = {"bytes": 0, "state": L.SLOT_ACTIVE}
    elif kind == "reattach":
        table.close()
        table, info = FlowTable.create_or_attach(path)
        assert sorted(info.kept_slots) == sorted(k[0] for k, v in model.items())
        for slot in live:
            slot.table = table
    elif live:
        slot = live[op[1] % len(live)]
        entry = model[(slot.index, slot.claim_seq)]
        if kind == "send" and entry["state"] == L.SLOT_ACTIVE:
            slot.send(op[2])
            entry["bytes"] += op[2]
        elif kind == "close" and entry["state"] == L.SLOT_ACTIVE:
            slot.close()
            entry["state"] = L.SLOT_CLOSED
        elif kind == "release":
            freed = table.release_slot(slot.index, slot.claim_seq)
            assert freed == (entry["state"] == L.SLOT_CLOSED)
            if freed:
                del model[(slot.index, slot.claim_seq)]
                live.remove(slot)
    return table


def _check(table, model) -> None:
    seen = {s.key: {"bytes": s.bytes, "state": s.state} for s in table.slots()}
    assert seen == model
    assert len({key[0] for key in seen}) == len(seen)  # two connections never share a slot


def test_table_of_a_running_agent_is_refused(table_path: str) -> None:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        table, _ = FlowTable.create_or_attach(table_path, num_slots=2, agent_pid=helper.pid)
        table.close()
        with pytest.raises(TableError, match=f"running agent \\(pid {helper.pid}"):
            FlowTable.create_or_attach(table_path)
    finally:
        helper.kill()
        helper.wait()
    FlowTable.create_or_attach(table_path)[0].close()  # its owner is gone: re-attach works
