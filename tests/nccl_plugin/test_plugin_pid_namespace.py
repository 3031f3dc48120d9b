"""The real plugin in a job that has a pid namespace of its own (a pod without hostPID), with a
real agent outside it: the agent links the plugin's connection to the job's SDK flow of the
same class, writes the flow's level into its slot, and frees the slot after the job exits;
also an agent process that may not read the job's namespace link (no CAP_SYS_PTRACE, as the
DaemonSet runs it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from pid_namespace import unshared
from plugin_job import end_job
from polling import wait_until

from flowsched.agent import AgentConfig
from flowsched.agent.threaded import AgentThread
from flowsched.shm import layout
from flowsched.shm.pidns import start_ticks
from flowsched.shm.table import FlowTable

_JOB = """
import os, sys, time
from flowsched import client
from flowsched.nccl.harness import Plugin, connect_pair, loopback_message
handle = client.open_flow(
    "param_sync", bytes=1 << 30, deadline=time.time() + 600, socket_path=sys.argv[2]
)
plugin = Plugin(sys.argv[1], 11)
ctx = plugin.init(comm_id=0x77, traffic_class=-1)
send, recv = connect_pair(ctx)
loopback_message(send, recv, b"x" * 100_000, tag=1)
print(os.getpid(), handle.id, flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def agent(local_agent_config: AgentConfig, fresh_sdk_connections: None) -> Iterator[AgentThread]:
    with AgentThread(local_agent_config) as running:
        yield running


def test_a_job_in_its_own_pid_namespace_gets_its_nccl_connection_linked_and_freed(
    agent: AgentThread, plugin_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert agent.ready is not None
    registry = agent.agent.registry
    assert registry is not None
    monkeypatch.setenv("FLOWSCHED_CLASS", "param_sync")  # the plugin's class for its comm
    job = unshared(sys.executable, "-c", _JOB, str(plugin_lib), agent.ready.socket)
    try:
        assert job.stdout is not None and job.stdin is not None
        inner, flow_id = map(int, job.stdout.readline().split())
        table = FlowTable.open(agent.ready.table)
        try:
            sends = [s for s in table.slots() if s.direction == layout.DIR_SEND]
            assert len(sends) == 1 and sends[0].pid == inner
            key = sends[0].key
            wait_until(lambda: key in registry.slots)
            assert registry.slots[key].linked_to == flow_id  # carried by the job's SDK flow
            wait_until(lambda: registry.flows[flow_id].sent >= 100_000)
            end_job(job, table)
        finally:
            table.close()
    finally:
        job.kill()
        job.wait()


_READY = re.compile(r"ready node=\S+ .*metrics=(?P<host>[\d.]+):(?P<port>\d+)")


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in lines)
        if name and not name.startswith("#")
    }


_CLAIM_AND_EXIT = """
import sys
from flowsched.shm.table import EmulatedPluginSlot, FlowTable
table = FlowTable.open(sys.argv[1], writable=True)
print(EmulatedPluginSlot(table, class_id=4, direction=1).index)  # a receive: never a flow
"""


@pytest.mark.parametrize("boottime", [None, 1000], ids=["host-clock", "own-time-namespace"])
def test_an_agent_without_ptrace_rights_places_and_links_a_job_in_its_own_pid_namespace(
    tmp_path: Path,
    plugin_env: Path,
    plugin_lib: Path,
    monkeypatch: pytest.MonkeyPatch,
    boottime: int | None,
) -> None:
    """An agent process as the DaemonSet runs it (uid 0, gid 10001, NET_ADMIN alone, uvloop)
    may not read a root job's /proc/<pid>/ns/pid: it places the job's slots by pid and start
    tick (the plugin writes the host's count, also from a time namespace of its own), links
    them by the namespace the job's SDK client shows it, and frees them after the job exits."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to run the agent without CAP_SYS_PTRACE")
    socket_path = tmp_path / "run" / "agent.sock"
    command = [
        "setpriv", "--reuid=0", "--regid=10001", "--clear-groups",
        "--bounding-set=-all,+net_admin", "--inh-caps=-all", "--",
        sys.executable, "-m", "flowsched", "agent", "--node", "n1", "--table", str(plugin_env),
        "--socket", str(socket_path), "--slots", "16", "--metrics-port", "0",
        "--interface", "lo", "--log-level", "INFO",
    ]  # fmt: skip
    log = (tmp_path / "agent.log").open("w")
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    job = None
    table = None
    try:
        assert agent.stdout is not None
        ready = None
        while ready is None and (line := agent.stdout.readline()):
            ready = _READY.search(line)
        assert ready is not None, (tmp_path / "agent.log").read_text()[-3000:]
        url = f"http://{ready['host']}:{ready['port']}/metrics"
        monkeypatch.setenv("FLOWSCHED_CLASS", "param_sync")
        job = unshared(
            sys.executable, "-c", _JOB, str(plugin_lib), str(socket_path), boottime=boottime
        )
        assert job.stdout is not None and job.stdin is not None
        inner = int(job.stdout.readline().split()[0])
        (host_pid,) = map(int, Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split())
        assert inner != host_pid
        table = FlowTable.open(str(plugin_env))
        (send,) = [s for s in table.slots() if s.direction == layout.DIR_SEND]
        assert send.start_ticks == start_ticks(Path(f"/proc/{host_pid}/stat").read_bytes())
        # another job's process claims a slot and exits: once the agent has freed that slot,
        # a reap pass has judged this job's slots too
        claimer = unshared(sys.executable, "-c", _CLAIM_AND_EXIT, str(plugin_env))
        assert claimer.stdout is not None
        index = int(claimer.stdout.readline())
        assert claimer.wait(timeout=10) == 0
        wait_until(lambda: table.slot_state(index) == layout.SLOT_FREE)  # type: ignore[union-attr]
        seen = _metrics(url)
        assert seen["flowsched_agent_table_slots_unplaced"] == 0  # the job's slots are placed
        sources = {k for k, v in seen.items() if k.startswith("flowsched_agent_active_flows") and v}
        assert [k for k in sources if 'source="plugin"' in k] == []  # carried by the SDK flow
        assert [k for k in sources if 'source="sdk"' in k] != []
        job.stdin.write("\n")
        job.stdin.flush()
        assert job.wait(timeout=10) == 0
        wait_until(lambda: all(s.state == layout.SLOT_FREE for s in table.slots()))  # type: ignore[union-attr]
    finally:
        if table is not None:
            table.close()
        if job is not None:
            job.kill()
            job.wait()
        agent.terminate()
        agent.wait(timeout=10)
        log.close()
