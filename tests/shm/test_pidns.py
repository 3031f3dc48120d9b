"""Tests of flowsched.shm.pidns: placing slot owners that live in another pid namespace, on a
fake /proc (every answer, and when it scans) and on a real one (a child in a namespace of its
own)."""

from __future__ import annotations

import os
import shutil
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pid_namespace import unshared

from flowsched.shm import layout as L
from flowsched.shm import pidns
from flowsched.shm.pidns import (
    UNKNOWN,
    PidNamespaces,
    boottime_offset_ticks,
    namespace_inode,
    nspids,
    start_ticks,
)
from flowsched.shm.table import EmulatedPluginSlot, FlowTable

OWN, JOB, OTHER = 4026531836, 4026532999, 4026533111


@pytest.mark.parametrize(
    "link,inode",
    [("pid:[4026531836]", 4026531836), ("pid:[]", 0), ("net:[4026531836]", 0), ("pid:[12x]", 0)],
)
def test_namespace_inode(link: str, inode: int) -> None:
    assert namespace_inode(link) == inode


@pytest.mark.parametrize(
    "status,pids",
    [
        (b"Name:\tpython\nNSpid:\t4242\t7\nNSsid:\t1\n", (4242, 7)),
        (b"Name:\tpython\nNSpid:\t4242\n", (4242,)),
        (b"Name:\tpython\nNSpid:\t4242\t7", (4242, 7)),  # last line, no newline
        (b"Name:\tpython\nPid:\t4242\n", ()),  # kernels before 4.1 have no NSpid line
        (b"Name:\tpython\nNSpid:\t4242\tx\n", ()),
    ],
)
def test_nspids(status: bytes, pids: tuple[int, ...]) -> None:
    assert nspids(status) == pids


def _stat(pid: int, start: int) -> bytes:
    """A /proc/<pid>/stat text whose field 22 is ``start`` (and whose command name misleads)."""
    return f"{pid} (a) b (c) S ".encode() + b" ".join([b"0"] * 18 + [str(start).encode()] * 31)


@pytest.mark.parametrize(
    "stat,ticks",
    [
        (_stat(42, 6051345), 6051345),
        (b"42 (python) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 777 9 9", 777),
        (b"42 (python) S 1 42", 0),  # cut short
        (b"42 (python) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 x 9", 0),
    ],
)
def test_start_ticks(stat: bytes, ticks: int) -> None:
    assert start_ticks(stat) == ticks


@pytest.mark.parametrize(
    "offsets,hz,ticks",
    [
        (b"monotonic           0         0\nboottime         1000         0\n", 100, 100_000),
        (b"monotonic 5 0\n", 100, 0),  # no boottime offset
        (b"", 100, 0),
        (b"7 -2 0\n", 100, -200),  # older kernels name the clock by its id
        (b"boottime 1 20000000\n", 100, 102),
        (b"boottime 0 5000000\n", 100, None),  # half a tick: starts cannot be compared
    ],
)
def test_boottime_offset_ticks(offsets: bytes, hz: int, ticks: int | None) -> None:
    assert boottime_offset_ticks(offsets, hz) == ticks


class FakeProc:
    """A /proc tree of symlinks, status and stat files, and a clock the test moves."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.now = 1_000
        root.mkdir()
        (root / "self" / "ns").mkdir(parents=True)
        os.symlink(f"pid:[{OWN}]", root / "self" / "ns" / "pid")

    def spawn(self, here: int, ns: int, inner: int, start: int = 5_000) -> None:
        (self.root / str(here) / "ns").mkdir(parents=True)
        os.symlink(f"pid:[{ns}]", self.root / str(here) / "ns" / "pid")
        pids = f"{here}\t{inner}" if ns != OWN else f"{here}"
        (self.root / str(here) / "status").write_text(f"Name:\tx\nNSpid:\t{pids}\n")
        (self.root / str(here) / "stat").write_bytes(_stat(here, start))

    def exit(self, here: int) -> None:
        shutil.rmtree(self.root / str(here))

    def namespaces(self) -> PidNamespaces:
        return PidNamespaces(str(self.root), clock_ns=lambda: self.now)


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def test_our_namespace_and_an_unknown_one_map_a_pid_to_itself(proc: FakeProc) -> None:
    spaces = proc.namespaces()
    assert spaces.own == OWN
    assert spaces.local_pid(OWN, 77) == 77 and spaces.local_pid(0, 77) == 77
    assert spaces.scans == 0


def test_an_owner_is_found_kept_and_lost_with_its_process(proc: FakeProc) -> None:
    proc.spawn(500, JOB, 7)
    proc.spawn(501, OWN, 501)
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 7, since_ns=900) == 500
    assert spaces.local_pid(JOB, 7, since_ns=900) == 500 and spaces.scans == 1  # cached
    proc.exit(500)
    proc.spawn(500, OWN, 500)  # its pid reused here: not the owner
    assert spaces.local_pid(JOB, 7, since_ns=900) is None
    assert spaces.scans == 1


def test_a_miss_is_gone_only_after_a_scan_that_began_after_the_claim(proc: FakeProc) -> None:
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 8, since_ns=900) is None and spaces.scans == 1
    assert spaces.local_pid(JOB, 9, since_ns=950) is None and spaces.scans == 1  # scanned at 1000
    proc.spawn(600, JOB, 10)
    proc.now = 1_000 + 10**9
    assert spaces.local_pid(JOB, 10, since_ns=1_500) == 600 and spaces.scans == 2
    proc.now += 10**9
    assert spaces.local_pid(JOB, 11, since_ns=0) is None and spaces.scans == 3  # claim time unknown


def test_scans_come_no_closer_than_the_minimum_interval(proc: FakeProc) -> None:
    """A table writer forging claims (or open_ns values ahead of the clock) cannot make the
    agent scan /proc more often: a scan due too soon leaves the owner unknown for now."""
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 8, since_ns=900) is None and spaces.scans == 1
    proc.spawn(610, JOB, 9)
    proc.now += int(pidns.MIN_SCAN_INTERVAL * 1e9) - 1
    assert spaces.local_pid(JOB, 9, since_ns=proc.now) == UNKNOWN and spaces.scans == 1
    assert spaces.local_pid(JOB, 9, since_ns=2**63) == UNKNOWN and spaces.scans == 1
    proc.now += 1
    assert spaces.local_pid(JOB, 9, since_ns=proc.now) == 610 and spaces.scans == 2


@pytest.mark.parametrize(
    "ns,pid,key", [(OWN, 7, 7), (0, 7, 7), (JOB, 7, JOB << 32 | 7), (JOB, 2**22, JOB << 32 | 2**22)]
)
def test_process_keys_name_a_process_by_its_namespace_and_pid(
    proc: FakeProc, ns: int, pid: int, key: int
) -> None:
    assert proc.namespaces().process_key(ns, pid) == key


def test_an_sdk_clients_key_comes_from_its_own_proc_entry(proc: FakeProc) -> None:
    proc.spawn(620, JOB, 3)
    proc.spawn(621, OWN, 621)
    spaces = proc.namespaces()
    assert spaces.key_of(620) == JOB << 32 | 3 and spaces.key_of(621) == 621
    assert spaces.key_of(622) == 622  # gone, or never there: its own pid, never linked
    assert spaces.scans == 0


def _deny(monkeypatch: pytest.MonkeyPatch, *suffixes: str) -> None:
    """Make reads of /proc paths that end with one of ``suffixes`` fail as the kernel refuses
    them (EACCES): a namespace link of a process the agent may not ptrace, a hidden file. The
    agent's own entries (``self``) stay readable."""
    readlink, opener = os.readlink, open

    def check(path: str) -> None:
        if str(path).endswith(suffixes) and "/self/" not in str(path):
            raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(pidns.os, "readlink", lambda p: check(p) or readlink(p))
    monkeypatch.setattr(pidns, "open", lambda p, *a: check(p) or opener(p, *a), raising=False)


def test_an_owner_that_cannot_be_placed_is_unknown_not_gone(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc.spawn(700, JOB, 12)
    proc.spawn(701, JOB, 13)
    _deny(monkeypatch, "/700/ns/pid")
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 12, since_ns=900) == UNKNOWN  # pid 12 is 700's, unplaced
    assert spaces.local_pid(JOB, 13, since_ns=900) == 701
    assert spaces.local_pid(JOB, 14, since_ns=900) is None  # no process has that pid there


def test_an_owner_whose_namespace_link_is_refused_is_placed_by_its_start(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ptrace rights the agent reads no job's namespace link; the pid there and the
    start tick (world-readable) tell two namespaces' processes of the same pid apart."""
    proc.spawn(700, JOB, 12, start=5_000)
    proc.spawn(701, OTHER, 12, start=6_000)
    proc.spawn(702, OWN, 702, start=5_000)
    _deny(monkeypatch, "/ns/pid")
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 12, since_ns=900, start=5_000) == 700
    assert spaces.local_pid(OTHER, 12, since_ns=900, start=6_000) == 701
    assert spaces.local_pid(JOB, 12, since_ns=900, start=5_001) is None  # no such process
    assert spaces.local_pid(JOB, 13, since_ns=900, start=5_000) is None
    assert spaces.local_pid(JOB, 12, since_ns=900) == UNKNOWN  # no start (an older plugin)
    assert spaces.scans == 1
    proc.exit(700)
    assert spaces.local_pid(JOB, 12, since_ns=900, start=5_000) is None  # its process left


def test_a_process_that_left_since_the_scan_does_not_make_an_owner_unknown(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc.spawn(700, JOB, 1, start=5_000)  # two pods' first processes
    proc.spawn(701, OTHER, 1, start=6_000)
    _deny(monkeypatch, "/ns/pid")
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 9, since_ns=900, start=1) is None and spaces.scans == 1
    proc.exit(701)
    assert spaces.local_pid(OTHER, 1, since_ns=900, start=6_000) is None
    assert spaces.local_pid(JOB, 1, since_ns=900, start=5_000) == 700 and spaces.scans == 1


@pytest.mark.parametrize(
    "denied",
    [
        pytest.param(("/ns/pid",), id="same-start"),  # two of pid 12 started in one tick
        pytest.param(("/ns/pid", "/701/stat"), id="a-start-unread"),
    ],
)
def test_a_start_two_processes_could_have_leaves_the_owner_unknown(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch, denied: tuple[str, ...]
) -> None:
    proc.spawn(700, JOB, 12, start=5_000)
    proc.spawn(701, OTHER, 12, start=5_000)
    _deny(monkeypatch, *denied)
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 12, since_ns=900, start=5_000) == UNKNOWN  # kept
    assert spaces.local_pid(JOB, 13, since_ns=900, start=5_000) is None


def test_an_entry_nothing_of_which_can_be_read_makes_every_miss_unknown(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc.spawn(700, JOB, 12)
    proc.spawn(701, JOB, 13)
    _deny(monkeypatch, "/700/ns/pid", "/700/status")  # /proc mounted with hidepid, say
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 13, since_ns=900) == 701  # placed as ever
    assert spaces.local_pid(JOB, 12, since_ns=900, start=5_000) == UNKNOWN
    assert spaces.local_pid(JOB, 14, since_ns=900) == UNKNOWN  # 700 could be that owner


def test_our_own_time_namespace_shifts_every_start_we_read(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    proc.spawn(700, JOB, 12, start=5_000 + 10 * hz)
    _deny(monkeypatch, "/ns/pid")
    (proc.root / "self" / "timens_offsets").write_text("monotonic 0 0\nboottime 10 0\n")
    spaces = proc.namespaces()
    assert spaces.start_of(700) == 5_000
    assert spaces.local_pid(JOB, 12, since_ns=900, start=5_000) == 700
    for offsets in ("boottime 0 1\n", "boottime x 0\n"):  # not a whole tick, not a number
        (proc.root / "self" / "timens_offsets").write_text(offsets)
        spaces = proc.namespaces()
        assert spaces.start_of(700) == 0
        assert spaces.local_pid(JOB, 12, since_ns=900, start=5_000) == UNKNOWN


@pytest.mark.parametrize(
    "link_readable,shown,key",
    [
        (True, 0, JOB << 32 | 3),
        (True, OTHER, JOB << 32 | 3),  # the kernel's word wins over the client's
        (False, JOB, JOB << 32 | 3),
        (False, 0, 620),  # an SDK client of an earlier release shows none: never linked
        (False, OWN, 620),
    ],
)
def test_an_sdk_client_is_keyed_by_the_namespace_it_shows_where_its_link_is_refused(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch, link_readable: bool, shown: int, key: int
) -> None:
    proc.spawn(620, JOB, 3)
    if not link_readable:
        _deny(monkeypatch, "/620/ns/pid")
    assert proc.namespaces().key_of(620, shown) == key


def test_a_client_in_a_namespace_its_link_does_not_name_is_hidden(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc.spawn(620, JOB, 3)
    proc.spawn(621, JOB, 4)
    proc.spawn(622, OWN, 622)
    _deny(monkeypatch, "/620/ns/pid", "/622/ns/pid")
    spaces = proc.namespaces()
    assert spaces.hidden(620) and not spaces.hidden(621) and not spaces.hidden(622)
    assert not spaces.hidden(623)  # gone


@pytest.mark.parametrize(
    "denied,answer",
    [("/700/ns/pid", 700), ("/700/status", 700)],  # it exists: never taken for gone
)
def test_a_placed_owner_whose_entry_turns_unreadable(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch, denied: str, answer: int | None
) -> None:
    proc.spawn(700, JOB, 12)
    spaces = proc.namespaces()
    assert spaces.local_pid(JOB, 12, since_ns=900) == 700
    _deny(monkeypatch, denied)
    assert spaces.local_pid(JOB, 12, since_ns=900) == answer


def test_nothing_is_foreign_when_our_own_namespace_cannot_be_read(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()  # no self/ns/pid
    spaces = PidNamespaces(str(tmp_path / "proc"))
    assert spaces.own == 0 and not spaces.foreign(JOB)
    assert spaces.local_pid(JOB, 7, since_ns=1) == 7 and spaces.scans == 0


def test_a_proc_that_cannot_be_listed_makes_every_miss_unknown(
    proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    spaces = proc.namespaces()

    def unlistable(path: str) -> list[str]:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(pidns.os, "listdir", unlistable)
    assert spaces.local_pid(JOB, 7, since_ns=900) == UNKNOWN


# ----------------------------------------------------------------- a real pid namespace

_CHILD = """
import os, sys
from flowsched.shm.table import EmulatedPluginSlot, FlowTable
table = FlowTable.open(sys.argv[1], writable=True)
slot = EmulatedPluginSlot(table, class_id=2)
print(os.getpid(), slot.index, flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def table(tmp_path: Path) -> Iterator[FlowTable]:
    created, _ = FlowTable.create_or_attach(str(tmp_path / "table"), num_slots=8)
    yield created
    created.detach()
    created.close()


def test_a_slot_written_in_another_namespace_is_kept_while_its_owner_lives(
    table: FlowTable,
) -> None:
    child = unshared(sys.executable, "-c", _CHILD, table.path)
    try:
        assert child.stdout is not None and child.stdin is not None
        inner, index = map(int, child.stdout.readline().split())
        snap = table.slot(index)
        assert snap is not None and snap.pid == inner and snap.pid_ns != table.pid_namespaces.own
        spaces = table.pid_namespaces
        here = spaces.local_pid(snap.pid_ns, inner, snap.open_ns)
        assert here is not None and here not in (UNKNOWN, inner)
        assert Path(f"/proc/{here}/cmdline").read_bytes().split(b"\0")[:2] == [
            sys.executable.encode(),
            b"-c",
        ]
        # linking: the slot and the process's SDK connection (SO_PEERCRED gives `here`) meet
        assert table.owner_key(snap) == spaces.key_of(here) == snap.pid_ns << 32 | inner
        assert table.reap_dead() == [] and table.last_reap.unplaced == []
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=10) == 0
        reaped = table.reap_dead()
        assert [s.index for s in reaped] == [index]  # the old code judged pid `inner` here
        assert spaces.local_pid(snap.pid_ns, inner, snap.open_ns) is None
    finally:
        child.kill()
        child.wait()


def test_a_freed_slot_forgets_its_owners_namespace(table: FlowTable) -> None:
    """A plugin older than ``pid_ns`` never writes it: the next owner of a slot must not be
    judged in its predecessor's namespace."""

    def pid_ns_word(index: int) -> int:
        offset = L.slot_offset(index) + L.SLOT_OFFSET["pid_ns"]
        return int(struct.unpack_from("<Q", table._mm, offset)[0])

    closed = EmulatedPluginSlot(table, pid_ns=JOB)
    closed.close()
    assert pid_ns_word(closed.index) == JOB
    assert table.release_slot(closed.index, closed.claim_seq)
    assert pid_ns_word(closed.index) == 0
    dead = EmulatedPluginSlot(table, pid_ns=JOB, pid=2**31 - 2)  # no such process anywhere
    assert pid_ns_word(dead.index) == JOB
    assert [s.index for s in table.reap_dead()] == [dead.index]
    assert pid_ns_word(dead.index) == 0


def test_a_reap_pass_places_each_owner_once_however_many_slots_it_has(
    table: FlowTable, proc: FakeProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc.spawn(800, JOB, 7)
    table.pid_namespaces = spaces = proc.namespaces()
    asked: list[tuple[int, int]] = []
    local_pid = spaces.local_pid

    def counted(ns: int, pid: int, since_ns: int = 0, start: int = 0) -> int | None:
        asked.append((ns, pid))
        return local_pid(ns, pid, since_ns, start)

    monkeypatch.setattr(spaces, "local_pid", counted)
    slots = [EmulatedPluginSlot(table, pid_ns=JOB, pid=7) for _ in range(5)]
    judged: list[int] = []

    def alive(pid: int) -> bool:
        judged.append(pid)
        return True

    assert table.reap_dead(alive=alive, started_ns=lambda pid: None) == []
    assert asked == [(JOB, 7)] and judged == [800]  # the host pid, judged once
    proc.exit(800)
    assert len(table.reap_dead(alive=alive, started_ns=lambda pid: None)) == len(slots)


def test_the_emulated_plugin_writes_its_own_namespace(table: FlowTable) -> None:
    slot = EmulatedPluginSlot(table)
    snap = table.slot(slot.index)
    assert snap is not None
    assert snap.pid_ns == namespace_inode(os.readlink("/proc/self/ns/pid")) != 0
    assert table.owner_key(snap) == os.getpid() == table.pid_namespaces.key_of(os.getpid())
