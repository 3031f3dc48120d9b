"""flowsched.shm.listing: what ``flowsched flows`` reads out of a flow table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pid_namespace import unshared
from polling import wait_until

from flowsched.model import FlowClass
from flowsched.shm import layout as L
from flowsched.shm.listing import connections, read_config, summarize, with_rates
from flowsched.shm.table import EmulatedPluginSlot, FlowTable, LevelMarking, TableConfig

CONFIG = TableConfig(
    num_levels=3,
    markings=(LevelMarking(46, 6), LevelMarking(26, 4), LevelMarking(8, 1)),
    default_levels=(0, 2, 1, 1, 2, 2),
)


@pytest.fixture
def table(tmp_path: Path) -> FlowTable:
    created, _ = FlowTable.create_or_attach(str(tmp_path / "table"), num_slots=8)
    created.write_config(CONFIG)
    return created


def test_a_connection_shows_its_process_class_levels_and_marking(table: FlowTable) -> None:
    conn = EmulatedPluginSlot(table, class_id=FlowClass.PARAM_SYNC, peer_rank=3, comm_id=0xAB)
    [row] = connections(table)
    assert (row.slot, row.pid, row.host_pid, row.cls, row.direction, row.peer_rank) == (
        conn.index, os.getpid(), None, "param_sync", "send", 3
    )  # fmt: skip
    assert row.command is not None and row.comm_id == 0xAB
    assert row.process == "running" and not row.other_namespace
    assert (row.level, row.applied_level, row.dscp) == (None, None, None)  # nothing sent yet
    conn.send(1000)  # the class default (1) goes on the sockets
    [row] = connections(table)
    assert (row.level, row.applied_level, row.dscp, row.bytes, row.messages) == (
        None, 1, 26, 1000, 1
    )  # fmt: skip
    table.set_level(conn.index, 0)  # the agent's decision, applied at the next message
    assert connections(table)[0].level == 0 and connections(table)[0].applied_level == 1
    conn.send(10)
    assert (connections(table)[0].applied_level, connections(table)[0].dscp) == (0, 46)


def test_closed_connections_are_shown_only_when_asked(table: FlowTable) -> None:
    EmulatedPluginSlot(table, direction=L.DIR_RECV).close()
    assert connections(table) == []
    [row] = connections(table, include_closed=True)
    assert (row.state, row.direction) == ("closed", "recv")


def test_rates_come_from_two_looks_at_the_same_claim(table: FlowTable) -> None:
    busy, reclaimed = EmulatedPluginSlot(table), EmulatedPluginSlot(table)
    before = connections(table)
    busy.send(5000)
    reclaimed.close()  # its slot goes to a new connection between the looks
    table.release_slot(reclaimed.index, reclaimed.claim_seq)
    again = EmulatedPluginSlot(table)
    again.send(7000)
    assert again.index == reclaimed.index
    rates = {row.slot: row.rate for row in with_rates(before, connections(table), 0.5)}
    assert rates == {busy.index: 10_000.0, again.index: None}


def test_a_moved_connection_and_an_unknown_class_are_named(table: FlowTable) -> None:
    conn = EmulatedPluginSlot(table, class_id=15)
    table._mm[L.slot_offset(conn.index) + L.SLOT_OFFSET["flags"]] = L.SLOT_FLAG_MOVED
    [row] = connections(table)
    assert row.moved and row.cls == "class 15"


def test_a_connection_of_a_process_that_exited_says_so(table: FlowTable) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           check=True, capture_output=True, text=True)  # fmt: skip
    EmulatedPluginSlot(table, pid=int(child.stdout))
    [row] = connections(table)
    assert row.process == "exited" and row.command is None


def test_a_pid_that_another_process_took_since_is_not_the_connections(table: FlowTable) -> None:
    # this process's pid, but a start long before it: the slot's owner exited, its pid reused
    EmulatedPluginSlot(table, pid=os.getpid(), start_ticks=1)
    [row] = connections(table)
    assert row.process == "exited" and row.command is None


def test_a_process_of_another_pid_namespace_is_not_named_by_a_pid_here(table: FlowTable) -> None:
    # pid 1 of a namespace /proc has no trace of: its pid there says nothing about a process here
    EmulatedPluginSlot(table, pid=1, pid_ns=table.pid_namespaces.own + 1)
    [row] = connections(table)
    assert (row.pid, row.other_namespace, row.host_pid, row.command) == (1, True, None, None)
    assert row.process == "not found"


_POD_JOB = """
import os, sys
from flowsched.shm.table import EmulatedPluginSlot, FlowTable
slot = EmulatedPluginSlot(FlowTable.open(sys.argv[1], writable=True), class_id=3)
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


_RENAMED_JOB = """
import os, sys
from flowsched.shm.table import EmulatedPluginSlot, FlowTable
with open("/proc/self/comm", "w") as comm:  # what prctl(PR_SET_NAME) sets: any 15 bytes
    comm.write(sys.argv[2])
slot = EmulatedPluginSlot(FlowTable.open(sys.argv[1], writable=True), class_id=3)
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        pytest.param("trainer", "trainer", id="plain"),
        pytest.param("a\x1b[2Jb", "a?[2Jb", id="escape-sequence"),
        pytest.param("ok\rforged", "ok?forged", id="carriage-return"),
        pytest.param("tab\tnl\x7f", "tab?nl?", id="tab-and-delete"),
    ],
)
def test_a_process_name_is_shown_without_control_characters(
    table: FlowTable, name: str, shown: str
) -> None:
    """A process names itself (``comm``): one of another user, listed to root, must not send
    the operator's terminal escape sequences or rewrite the line, as ``ps`` does not."""
    job = subprocess.Popen(
        [sys.executable, "-c", _RENAMED_JOB, table.path, name],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert job.stdout is not None
        job.stdout.readline()  # its slot is written
        [row] = connections(table)
        assert row.command == shown
    finally:
        job.kill()
        job.wait()


def test_a_process_in_a_pid_namespace_of_its_own_is_shown_by_its_pid_here(
    table: FlowTable,
) -> None:
    job = unshared(sys.executable, "-c", _POD_JOB, table.path)  # a pod without hostPID
    try:
        assert job.stdout is not None and job.stdin is not None
        inner = int(job.stdout.readline())
        [row] = connections(table)
        assert (row.pid, row.other_namespace, row.cls) == (inner, True, "kv")
        assert row.host_pid not in (None, inner)
        assert row.command is not None and row.command.startswith("python")
        assert (
            Path(f"/proc/{row.host_pid}/cmdline").read_bytes().startswith(sys.executable.encode())
        )
        assert row.process == "running"
        job.kill()
        job.wait()
        # its namespace went with it: from here, /proc has no trace of the process
        wait_until(lambda: connections(table)[0].process == "not found")
    finally:
        job.kill()
        job.wait()


def test_connections_are_listed_without_dscps_when_the_config_cannot_be_read(
    table: FlowTable,
) -> None:
    conn = EmulatedPluginSlot(table, class_id=FlowClass.KV)
    conn.send(100)
    writable = FlowTable.open(table.path, writable=True)
    writable._u32[L.HEADER_OFFSET["config_seq"] // 4] |= 1  # an agent died while writing it
    config, problem = read_config(table)
    assert config is None and problem is not None and "seqlock" in problem
    [row] = connections(table, config=config)
    assert (row.applied_level, row.dscp) == (1, None)
    writable._u32[L.HEADER_OFFSET["config_seq"] // 4] += 1
    writable._mm[L.HEADER_OFFSET["level_marking"]] = 200  # level 0's DSCP, out of range
    config, problem = read_config(table)
    assert config is None and problem is not None and "dscp" in problem
    writable.close()


@pytest.mark.parametrize(
    ("agent_pid", "beat_age_ns", "coordinator", "alive"),
    [
        (4242, 10**8, True, True),
        (4242, 10**8, False, True),
        (4242, 5 * 10**9, True, False),  # its heartbeat stopped: not running
        (0, 10**8, False, False),  # detached
    ],
)
def test_the_summary_says_whether_an_agent_runs_and_who_decides(
    table: FlowTable, agent_pid: int, beat_age_ns: int, coordinator: bool, alive: bool
) -> None:
    writable = FlowTable.open(table.path, writable=True)
    writable._put("agent_pid", agent_pid)
    writable.heartbeat(now_ns=10**12)
    writable.set_flag(L.FLAG_COORDINATOR_CONNECTED, coordinator)
    summary = summarize(table, now_ns=10**12 + beat_age_ns)
    assert (summary.agent_alive, summary.coordinator_connected) == (alive, coordinator)
    assert summary.heartbeat_age_s == pytest.approx(beat_age_ns / 1e9)
    assert (summary.num_slots, summary.num_levels, summary.generation) == (8, 3, 1)
    writable.close()
