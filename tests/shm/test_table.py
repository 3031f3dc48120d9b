"""Tests of flowsched.shm.table: round trip, corruption, permissions, claim/close sequences."""

from __future__ import annotations

import functools
import os
import stat
import struct
import subprocess
import sys
import threading
import time
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


class _AfterRead:
    """A word view running ``hook`` once right after the first read of word ``word``."""

    def __init__(self, words: memoryview, word: int, hook: object) -> None:
        self.words, self._word, self._hook = words, word, hook

    def __getitem__(self, key: int) -> int:
        value: int = self.words[key]
        if key == self._word and callable(self._hook):
            hook, self._hook = self._hook, None
            hook()
        return value

    def __setitem__(self, key: int, value: int) -> None:
        self.words[key] = value


def test_release_keeps_a_slot_reused_after_its_claim_seq_was_read(table_path: str) -> None:
    """A plugin that sees no live agent claims the CLOSED slot just after the agent read its
    claim_seq, sends and closes: the slot is CLOSED again, for a connection not reported yet.
    The agent must not free it (the connection would never be reported)."""
    table, _ = FlowTable.create_or_attach(table_path, num_slots=1)
    with table:
        first = EmulatedPluginSlot(table)
        first.close()
        later: list[EmulatedPluginSlot] = []

        def reuse() -> None:
            later.append(EmulatedPluginSlot(table, take_closed=True))
            later[0].send(10)
            later[0].close()

        words = table._u64
        word = (L.slot_offset(first.index) + L.SLOT_OFFSET["claim_seq"]) // 8
        table._u64 = _AfterRead(words, word, reuse)  # type: ignore[assignment]
        try:
            freed = table.release_slot(first.index, first.claim_seq)
        finally:
            table._u64 = words
        assert later
        snap = table.slot(first.index)
        assert not freed and snap is not None, (freed, table.slot_state(first.index))
        assert (snap.state, snap.claim_seq, snap.bytes) == (L.SLOT_CLOSED, later[0].claim_seq, 10)


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


def test_a_fifo_at_the_path_is_refused_without_blocking(tmp_path: Path) -> None:
    # another user's FIFO at a table path in a shared directory: a read-only open without
    # O_NONBLOCK waits for a writer for good (``flowsched flows`` hung)
    path = tmp_path / "table"
    os.mkfifo(path)
    outcome: list[BaseException] = []

    def open_it() -> None:
        try:
            FlowTable.open(str(path)).close()
        except BaseException as exc:
            outcome.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(10)
    if opener.is_alive():  # let the thread end: a writer side releases the blocked open
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("FlowTable.open blocked on a FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], TableError), outcome
    assert "not a regular file" in str(outcome[0])


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


# ---------------------------------------------------------------- reaper: odd pids (#4)


def _put_pid(table: FlowTable, index: int, pid: int) -> None:
    table._u32[(L.slot_offset(index) + L.SLOT_OFFSET["pid"]) // 4] = pid


@pytest.mark.parametrize(
    "bad_pid",
    [
        pytest.param(0, id="zero"),
        pytest.param(2**31, id="2^31"),
        pytest.param(2**32 - 1, id="u32-max"),
    ],
)
def test_a_slot_with_no_possible_pid_is_reaped_and_the_pass_goes_on(
    table_path: str, dead_pid: int, bad_pid: int
) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=4)
    with table:
        odd = EmulatedPluginSlot(table)
        _put_pid(table, odd.index, bad_pid)  # what a table writer can store
        dead = EmulatedPluginSlot(table, pid=dead_pid)
        alive = EmulatedPluginSlot(table)
        reaped = table.reap_dead()
        assert sorted(s.index for s in reaped) == sorted([odd.index, dead.index])
        assert table.last_reap.bad_pid == [odd.index] and not table.last_reap.errors
        assert table.slot_state(alive.index) == L.SLOT_ACTIVE


def test_an_error_on_one_slot_never_stops_the_reaper(table_path: str, dead_pid: int) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=4)
    with table:
        slots = [EmulatedPluginSlot(table, pid=pid) for pid in (dead_pid, 4242, dead_pid)]

        def alive(pid: int) -> bool:
            if pid == 4242:
                raise OSError("cannot tell")
            return False

        reaped = table.reap_dead(alive=alive, started_ns=lambda pid: None)
        assert sorted(s.index for s in reaped) == sorted([slots[0].index, slots[2].index])
        assert [index for index, _ in table.last_reap.errors] == [slots[1].index]
        assert table.slot_state(slots[1].index) == L.SLOT_ACTIVE


@pytest.mark.parametrize("pid", [0, -1, 2**31, 2**32 - 1, 2**40])
def test_pid_alive_is_false_for_numbers_no_process_can_have(pid: int) -> None:
    assert table_module.pid_alive(pid) is False


# ---------------------------------------------------------------- reaper: cost (#9)


def test_reaping_a_large_empty_table_does_no_per_slot_python_work(table_path: str) -> None:
    """65,536 FREE slots: the states are read with one strided copy, not a Python loop."""
    table, _ = FlowTable.create_or_attach(table_path, num_slots=65_536)
    with table:
        calls: list[str] = []

        def profile(frame: object, event: str, arg: object) -> None:
            if event in ("call", "c_call"):
                calls.append(event)

        sys.setprofile(profile)
        try:
            assert table.reap_dead() == []
        finally:
            sys.setprofile(None)
        assert len(calls) < 50, f"{len(calls)} calls"


def test_reaping_a_large_table_judges_only_its_busy_slots_each_pid_once(
    table_path: str, dead_pid: int
) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=65_536)
    with table:
        for pid in (os.getpid(), os.getpid(), dead_pid):
            EmulatedPluginSlot(table, pid=pid)
        asked: list[int] = []

        def alive(pid: int) -> bool:
            asked.append(pid)
            return table_module.pid_alive(pid)

        assert len(table.reap_dead(alive=alive)) == 1
        assert sorted(asked) == sorted([os.getpid(), dead_pid])


# ---------------------------------------------------------------- reaper: pid reuse (#7)


def _stat_text(pid: int, start_ticks: int) -> bytes:
    fields = ["S"] + ["0"] * 18 + [str(start_ticks)] + ["0"] * 30  # field 3 .. field 22 ..
    return f"{pid} (a (weird) comm) ".encode() + " ".join(fields).encode()


def _ticks_at(mono_ns: int) -> int:
    """The /proc start time (clock ticks since boot) of a process started at ``mono_ns``."""
    hz = os.sysconf("SC_CLK_TCK")
    offset = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.clock_gettime_ns(
        time.CLOCK_MONOTONIC
    )
    return (mono_ns + offset) * hz // 1_000_000_000


@pytest.mark.parametrize(
    ("started_after_claim_s", "reaped"),
    [
        pytest.param(None, False, id="proc-unreadable: alive"),
        pytest.param(-3600.0, False, id="started-before-the-claim"),
        pytest.param(0.0, False, id="same-tick"),
        pytest.param(1 / os.sysconf("SC_CLK_TCK"), False, id="one-tick-later: tolerance"),
        pytest.param(1.0, True, id="a-second-later: pid reused"),
        pytest.param(3600.0, True, id="an-hour-later: pid reused"),
    ],
)
def test_a_slot_whose_pid_now_names_a_later_process_is_reaped(
    table_path: str, started_after_claim_s: float | None, reaped: bool
) -> None:
    table, _ = FlowTable.create_or_attach(table_path, num_slots=2)
    with table:
        conn = EmulatedPluginSlot(table)  # our pid: alive
        open_ns = table.slot(conn.index).open_ns  # type: ignore[union-attr]

        def read(path: str) -> bytes:
            assert path == f"/proc/{os.getpid()}/stat"
            if started_after_claim_s is None:
                raise PermissionError(path)
            return _stat_text(os.getpid(), _ticks_at(open_ns + int(started_after_claim_s * 1e9)))

        started = functools.partial(table_module.process_start_ns, read=read)
        freed = table.reap_dead(started_ns=started)
        assert bool(freed) is reaped
        assert (table.last_reap.reused_pid == [conn.index]) is reaped
        assert (table.slot_state(conn.index) == L.SLOT_FREE) is reaped


def test_our_own_start_time_is_before_now() -> None:
    started = table_module.process_start_ns(os.getpid())
    assert started is not None and started <= time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    assert table_module.process_start_ns(2**31 + 5) is None


# ---------------------------------------------------------------- header counters (#5)


@settings(max_examples=200, deadline=None)
@given(seq=st.integers(0, 2**32 - 1))
def test_write_config_leaves_config_seq_even_and_moved_from_any_value(
    tmp_path_factory: pytest.TempPathFactory, seq: int
) -> None:
    path = str(tmp_path_factory.mktemp("t") / "table")
    table, _ = FlowTable.create_or_attach(path, num_slots=1)
    with table:
        table._u32[L.HEADER_OFFSET["config_seq"] // 4] = seq
        table.write_config(CONFIG)
        after = table._u32[L.HEADER_OFFSET["config_seq"] // 4]
        assert after % 2 == 0 and after != seq
        assert table.config_matches(CONFIG) and table.read_config().num_levels == 4


@pytest.mark.parametrize(
    ("field", "value", "expected", "repaired"),
    [
        pytest.param("config_seq", 0xFFFFFFFF, 0xFFFFFFFF, ["config_seq"], id="odd-seq-at-u32-max"),
        pytest.param("config_seq", 7, 7, ["config_seq"], id="odd-seq-kept-for-write-config"),
        pytest.param("config_seq", 6, 6, [], id="even-seq-kept"),
        pytest.param("generation", 2**64 - 1, 1, [], id="generation-wraps-past-zero"),
        pytest.param("generation", 41, 42, [], id="generation-bumped"),
        pytest.param("agent_pid", 2**32 - 1, None, [], id="agent-pid-no-process"),
    ],
)
def test_header_counters_at_attach_are_repaired_or_wrapped(
    table_path: str, field: str, value: int, expected: int | None, repaired: list[str]
) -> None:
    FlowTable.create_or_attach(table_path, num_slots=2)[0].close()
    with open(table_path, "r+b") as f:
        offset, fmt = next((o, fm) for n, o, fm in L.HEADER_FIELDS if n == field)
        f.seek(offset)
        f.write(struct.pack(fmt, value))
    table, info = FlowTable.create_or_attach(table_path)
    with table:
        if expected is not None:
            assert table.header()[field] == expected
        assert [r.split(":")[0] for r in info.repaired] == repaired
        table.write_config(CONFIG)
        assert table.header()["config_seq"] % 2 == 0 and table.config_matches(CONFIG)


def test_a_header_value_the_agent_cannot_use_is_an_error_naming_the_field(
    table_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    FlowTable.create_or_attach(table_path, num_slots=2)[0].close()

    def broken(pid: int) -> bool:
        raise OverflowError("signed integer is greater than maximum")

    monkeypatch.setattr(table_module, "pid_alive", broken)
    with pytest.raises(TableError, match="header field agent_pid holds"):
        FlowTable.create_or_attach(table_path)


# ---------------------------------------------------------------- half-built tables (#6)


@pytest.mark.parametrize(
    "size",
    [
        pytest.param(0, id="size-zero"),
        pytest.param(L.table_size(8), id="full-size-all-zero"),
        pytest.param(L.HEADER_SIZE, id="header-only-all-zero"),
    ],
)
def test_a_table_whose_creator_died_is_built_afresh(table_path: str, size: int) -> None:
    with open(table_path, "wb") as f:
        f.truncate(size)
    os.chmod(table_path, 0o600)
    table, info = FlowTable.create_or_attach(table_path, num_slots=4)
    with table:
        assert info.created and table.num_slots == 4
        assert os.path.getsize(table_path) == L.table_size(4)
        assert FlowTable.open(table_path).num_slots == 4


def test_a_new_table_appears_only_complete_and_leftovers_are_removed(
    table_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = os.path.dirname(table_path)
    leftover = os.path.join(directory, ".table.x1y2z3.building")  # a killed builder's file
    Path(leftover).write_bytes(b"\0" * 100)

    def killed(self: FlowTable, num_slots: int, agent_pid: int) -> None:
        raise KeyboardInterrupt  # stands in for a kill in the middle of building

    monkeypatch.setattr(FlowTable, "_initialize", killed)
    with pytest.raises(KeyboardInterrupt):
        FlowTable.create_or_attach(table_path, num_slots=4)
    assert os.listdir(directory) == []  # neither a half-built table nor its temporary file
    monkeypatch.undo()
    Path(leftover).write_bytes(b"\0" * 100)
    FlowTable.create_or_attach(table_path, num_slots=4)[0].close()
    assert os.listdir(directory) == ["table"]


def test_agents_starting_at_once_never_both_initialize(tmp_path: Path) -> None:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for round_ in range(10):
            path = str(tmp_path / f"r{round_}" / "table")
            start = threading.Barrier(2)
            results: list[object] = [None, None]

            def agent(slot: int, pid: int, path: str = path, start=start, results=results) -> None:
                start.wait()
                try:
                    table, info = FlowTable.create_or_attach(path, num_slots=65_536, agent_pid=pid)
                    table.close()
                    results[slot] = info
                except TableError as exc:
                    results[slot] = exc

            threads = [
                threading.Thread(target=agent, args=(i, pid))
                for i, pid in enumerate((os.getpid(), helper.pid))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            won = [r for r in results if isinstance(r, table_module.AttachInfo)]
            lost = [r for r in results if isinstance(r, TableError)]
            assert len(won) == 1 and won[0].created, results
            assert len(lost) == 1 and "owned by a running agent" in str(lost[0]), results
    finally:
        helper.kill()
        helper.wait()
