"""``flowsched flows`` on a live node: a real agent, a job process sending through the real
plugin, and the command run as a user would, reading the table the plugin found."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugin_job import SENDING_JOB, applied, end_job
from polling import wait_until

from flowsched.agent import AgentConfig
from flowsched.agent.threaded import AgentThread
from flowsched.shm import layout
from flowsched.shm.table import FlowTable


def _flows(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "flowsched", "flows", *args],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout  # fmt: skip


@contextlib.contextmanager
def _sending_job(
    script: str, plugin_lib: Path, table_path: Path
) -> Iterator[tuple[int, FlowTable, list[int]]]:
    """Run the job ``script`` (it sends through the plugin until told to stop) and wait until
    the agent's levels are on its send connections; yields its pid, the table and the send
    connections' slots. The job is told to end (and checked to end cleanly) after the block,
    and killed if it did not."""
    job = subprocess.Popen(
        [sys.executable, "-c", script, str(plugin_lib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "FLOWSCHED_CLASS": "param_sync"},
        text=True,
    )
    try:
        assert job.stdout is not None
        pid = int(job.stdout.readline())
        with FlowTable.open(str(table_path)) as table:
            sending = [s.index for s in table.slots() if s.direction == layout.DIR_SEND]
            wait_until(lambda: all(applied(table, index) for index in sending))
            yield pid, table, sending
            end_job(job, table)
    finally:
        job.kill()
        job.wait()


def test_flows_lists_a_jobs_connections_with_the_agents_levels_and_their_rates(
    plugin_env: Path, plugin_lib: Path, local_agent_config: AgentConfig
) -> None:
    with (
        AgentThread(local_agent_config),
        _sending_job(SENDING_JOB, plugin_lib, plugin_env) as (pid, table, sending),
    ):
        config = table.read_config()
        # FLOWSCHED_TABLE names the table, as the job's plugin found it
        document = json.loads(_flows("--json", "--interval", "0.3"))
        rows = {row["slot"]: row for row in document["connections"]}
        assert document["table"]["agent_pid"] == os.getpid()
        assert document["table"]["agent_alive"] is True
        assert {row["pid"] for row in rows.values()} == {pid}
        assert {row["cls"] for row in rows.values()} == {"param_sync"}
        assert {row["direction"] for row in rows.values()} == {"send", "recv"}
        assert {row["process"] for row in rows.values()} == {"running"}
        assert {int(row["comm_id"], 16) for row in rows.values()} == {0x99}
        for index in sending:
            row = rows[index]
            assert row["applied_level"] == row["level"] is not None
            assert row["dscp"] == config.marking(row["level"]).dscp
            assert row["rate"] > 0 and row["bytes"] >= 100_000
        text = _flows("--interval", "0")
        assert f"agent pid {os.getpid()}" in text and "param_sync" in text
        assert "RATE" not in text
        busiest = _flows("--interval", "0.3").splitlines()[2]  # header, titles, rows
        assert busiest.split()[1] == str(pid) and "bit/s" in busiest


#: the sending job with an SDK flow of the connections' class open around it: the agent links
#: the job's param_sync send connections to it
SDK_JOB = (
    "from flowsched import client\n"
    "flow = client.open_flow('param_sync', bytes=1 << 30, job='train')\n"
    "assert flow.connected\n" + SENDING_JOB
)


def test_flows_lists_the_sdk_flows_and_marks_the_connections_that_carry_them(
    plugin_env: Path,
    plugin_lib: Path,
    local_agent_config: AgentConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLOWSCHED_SOCKET", local_agent_config.socket_path)
    with (
        AgentThread(local_agent_config),
        _sending_job(SDK_JOB, plugin_lib, plugin_env) as (pid, _, sending),
    ):
        document = json.loads(_flows("--json", "--interval", "0"))
        [flow] = document["sdk"]["flows"]
        assert document["sdk"]["everyone"] is True
        assert document["sdk"]["socket"] == local_agent_config.socket_path
        assert (flow["pid"], flow["job"], flow["cls"]) == (pid, "train", "param_sync")
        carried = {row["slot"]: row["sdk_flow"] for row in document["connections"]}
        claims = {row["slot"]: row["claim_seq"] for row in document["connections"]}
        assert flow["slots"] == [[index, claims[index]] for index in sorted(sending)]
        assert flow["size"] == 1 << 30
        assert {carried[index] for index in sending} == {flow["id"]}
        assert {v for k, v in carried.items() if k not in sending} == {None}  # recv
        text = _flows("--interval", "0")
        assert "1 SDK flows (every user's)" in text and f"sdk {flow['id']}" in text
        sdk_rows = text.split("SDK flows")[1].splitlines()
        assert any(line.split()[:2] == [str(flow["id"]), str(pid)] for line in sdk_rows)
        alone = json.loads(_flows("--json", "--interval", "0", "--no-sdk"))
        assert alone["sdk"]["problem"] == "not asked (--no-sdk)"
