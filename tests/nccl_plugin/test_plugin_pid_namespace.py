"""The real plugin in a job that has a pid namespace of its own (a pod without hostPID), with a
real agent outside it: the agent links the plugin's connection to the job's SDK flow of the
same class, writes the flow's level into its slot, and frees the slot after the job exits."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pid_namespace import unshared
from polling import wait_until

from flowsched.agent import AgentConfig
from flowsched.agent.threaded import AgentThread
from flowsched.shm import layout
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
def agent(tmp_path: Path, plugin_env: Path, fresh_sdk_connections: None) -> Iterator[AgentThread]:
    config = AgentConfig(
        node="n1",
        socket_path=str(tmp_path / "run" / "agent.sock"),
        table_path=str(plugin_env),
        num_slots=16,
        metrics_port=None,
        interfaces=("lo",),
    )
    with AgentThread(config) as running:
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
            job.stdin.write("\n")
            job.stdin.flush()
            assert job.wait(timeout=10) == 0
            wait_until(lambda: all(s.state == layout.SLOT_FREE for s in table.slots()))
        finally:
            table.close()
    finally:
        job.kill()
        job.wait()
