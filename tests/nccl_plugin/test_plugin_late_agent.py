"""A job that started before the node's agent (a node boot where the job's pod came up first,
an agent that was down): its NCCL connections, made with no flow table, move into the agent's
table once it exists, and the agent schedules them like any other."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from plugin_job import SENDING_JOB, applied, end_job
from polling import wait_until

from flowsched.agent import AgentConfig
from flowsched.agent.threaded import AgentThread
from flowsched.shm import layout
from flowsched.shm.table import FlowTable


def test_a_job_that_started_before_the_agent_is_scheduled_once_it_runs(
    plugin_env: Path, plugin_lib: Path, local_agent_config: AgentConfig
) -> None:
    env = {**os.environ, "FLOWSCHED_CLASS": "param_sync"}
    job = subprocess.Popen(
        [sys.executable, "-c", SENDING_JOB, str(plugin_lib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert job.stdout is not None and job.stdin is not None
        pid = int(job.stdout.readline())
        assert not plugin_env.exists()  # the job's connections are on private slots
        agent_started = time.time()
        with AgentThread(local_agent_config) as agent:
            registry = agent.agent.registry
            assert registry is not None
            wait_until(lambda: any(c.pid == pid and c.flow_id for c in registry.slots.values()))
            [(key, conn)] = [
                (k, c) for k, c in registry.slots.items() if c.direction == layout.DIR_SEND
            ]
            assert conn.flow_id is not None
            flow = registry.flows[conn.flow_id]
            assert flow.sent >= 100_000 and flow.opened_at < agent_started
            with FlowTable.open(str(plugin_env)) as table:
                snap = table.slot(key[0])
                assert snap is not None and snap.flags & layout.SLOT_FLAG_MOVED
                # the level the agent decided for the flow is the one the job applies
                wait_until(lambda: applied(table, key[0]))
                end_job(job, table)
    finally:
        job.kill()
        job.wait()
