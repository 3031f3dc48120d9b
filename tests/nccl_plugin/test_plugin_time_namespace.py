"""The real plugin in a job whose time namespace (CLONE_NEWTIME, as a container may have) sets
its CLOCK_MONOTONIC apart from the host's, with a real agent on the host's clock: the slots'
``*_ns`` fields are on the host's clock, and the agent's reaper keeps the live job's slots."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pid_namespace import unshared
from plugin_job import SENDING_JOB, end_job
from polling import wait_until

from flowsched.agent import AgentConfig
from flowsched.agent.threaded import AgentThread
from flowsched.shm import layout
from flowsched.shm.table import FlowTable, monotonic_ns

_CLAIM_AND_EXIT = """
import sys
from flowsched.shm.table import EmulatedPluginSlot, FlowTable
table = FlowTable.open(sys.argv[1], writable=True)
print(EmulatedPluginSlot(table, class_id=4, direction=1).index)
"""


@pytest.fixture
def agent(local_agent_config: AgentConfig) -> Iterator[AgentThread]:
    with AgentThread(local_agent_config) as running:
        yield running


@pytest.mark.parametrize("sign", [-1, 1], ids=["clocks-behind", "clocks-ahead"])
def test_a_job_in_a_time_namespace_writes_the_hosts_clock_and_keeps_its_slots(
    agent: AgentThread, plugin_lib: Path, sign: int
) -> None:
    assert agent.ready is not None
    # behind: no further than the host's clocks have run (the namespace's may not go negative)
    offset = sign * int(min(300, time.clock_gettime(time.CLOCK_MONOTONIC) / 2))
    job = unshared(
        sys.executable, "-c", SENDING_JOB, str(plugin_lib), boottime=offset, monotonic=offset
    )
    table = FlowTable.open(agent.ready.table)
    try:
        assert job.stdout is not None
        inner = int(job.stdout.readline())
        jobs = [s.index for s in table.slots() if s.pid == inner]
        assert len(jobs) == 2
        # another process claims a slot and exits: once the agent has freed that slot, a reap
        # pass has judged the job's slots too
        claimer = unshared(sys.executable, "-c", _CLAIM_AND_EXIT, agent.ready.table)
        assert claimer.stdout is not None
        index = int(claimer.stdout.readline())
        assert claimer.wait(timeout=10) == 0
        wait_until(lambda: table.slot_state(index) == layout.SLOT_FREE)
        states = [table.slot_state(i) for i in jobs]
        assert states == [layout.SLOT_ACTIVE] * 2, "the live job's slots were reaped"
        now = monotonic_ns()
        for i in jobs:
            snap = table.slot(i)
            assert snap is not None
            assert 0 <= now - snap.open_ns < 60e9, f"open_ns {snap.open_ns}, host's {now}"
            assert 0 <= now - snap.last_ns < 60e9, f"last_ns {snap.last_ns}, host's {now}"
        end_job(job, table)
    finally:
        table.close()
        job.kill()
        job.wait()
