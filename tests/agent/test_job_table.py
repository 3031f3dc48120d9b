"""Job names at the agent: scoped to the client's uid, bounded, expired (issue 12)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from agent_helpers import wait_until

from flowsched import client
from flowsched.agent import AgentConfig
from flowsched.agent.flows import FlowRegistry, JobTable
from flowsched.agent.service import Agent
from flowsched.agent.threaded import AgentThread
from flowsched.protocol import JOB_END_VERSION, JobProgress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_names_are_scoped_to_their_owner() -> None:
    table = JobTable()
    mine, _ = table.record(1000, "train", 5, None)
    theirs, _ = table.record(1001, "train", 9, 2)
    assert (mine.job, theirs.job, theirs.layer) == ("1000/train", "1001/train", 2)
    assert table.record(None, "train", 1, None)[0].job == "train"  # in-process callers


@pytest.mark.parametrize(
    ("per_owner", "total", "records", "kept", "dropped"),
    [
        # one owner beyond its share: its own least recently updated goes
        (2, 10, [(1, "a"), (1, "b"), (1, "c")], {"1/b", "1/c"}, ["1/a"]),
        # an update refreshes a job: the other one is the oldest then
        (2, 10, [(1, "a"), (1, "b"), (1, "a"), (1, "c")], {"1/a", "1/c"}, ["1/b"]),
        # the node's total: the oldest of anyone goes, other owners' shares stay bounded too
        (5, 3, [(1, "a"), (2, "b"), (3, "c"), (3, "d")], {"2/b", "3/c", "3/d"}, ["1/a"]),
    ],
)
def test_names_are_bounded(
    per_owner: int,
    total: int,
    records: list[tuple[int, str]],
    kept: set[str],
    dropped: list[str],
) -> None:
    table = JobTable(per_owner=per_owner, total=total)
    gone: list[str] = []
    for owner, job in records:
        gone += table.record(owner, job, 1, None)[1]
    assert {u.job for u in table.latest()} == kept
    assert gone == dropped


def test_names_without_progress_expire() -> None:
    clock = Clock()
    table = JobTable(ttl=10.0, clock=clock)
    table.record(1, "old", 1, None)
    clock.now = 6.0
    table.record(1, "new", 1, None)
    clock.now = 12.0
    assert table.expire() == ["1/old"]
    assert [u.job for u in table.latest()] == ["1/new"]
    clock.now = 17.0
    assert table.expire() == ["1/new"] and len(table) == 0


def test_the_agent_scopes_an_sdk_clients_job_to_its_uid(tmp_path: Path) -> None:
    config = AgentConfig(
        node="n1",
        socket_path=str(tmp_path / "flowsched" / "agent.sock"),
        table_path=str(tmp_path / "flowsched" / "table"),
        num_slots=8,
        metrics_port=None,
        interfaces=("lo",),
    )
    with AgentThread(config) as running:
        try:
            assert client.job_progress("train", 12, socket_path=config.socket_path)
            registry = running.agent.registry
            assert registry is not None
            wait_until(lambda: registry.job_index.get(f"{os.geteuid()}/train") == 12)
            assert "train" not in registry.job_index  # another uid's "train" is another job
        finally:
            for conn in list(client._connections.values()):
                conn.close()
            client._connections.clear()


def test_a_jobs_end_goes_to_a_coordinator_that_understands_it_only() -> None:
    """``done`` only on a version-4 link (an older coordinator refuses the field); a resync
    carries the ends not sent yet, after every running job's latest progress."""
    config = AgentConfig(
        node="n1", socket_path="unused", metrics_port=None, coordinator=("127.0.0.1", 1)
    )
    agent = Agent(config)
    agent.registry = FlowRegistry(node="n1", links=("n1:tx",), id_prefix=1)
    agent.job_progress("batch", 7, 7, owner=1000)
    agent.job_progress("other", 2, None, owner=1000)
    assert [u.job for u in agent._take_job_updates(JOB_END_VERSION)] == ["1000/batch", "1000/other"]
    agent.job_progress("batch", 8, None, owner=1000, done=True)
    assert "1000/batch" not in agent.registry.job_index
    assert agent._take_job_updates(JOB_END_VERSION - 1) == []
    agent.job_progress("batch", 8, None, owner=1000, done=True)
    ended = JobProgress("1000/batch", 8, None, done=True)
    assert agent._latest_jobs(JOB_END_VERSION) == [JobProgress("1000/other", 2, None), ended]
    agent.job_progress("batch", 8, None, owner=1000, done=True)
    assert agent._take_job_updates(JOB_END_VERSION) == [ended]


def test_the_agent_publishes_a_jobs_layer_as_the_coordinator_does() -> None:
    """The local policy (the agent's fallback) sees ``"<job>/layer"`` like the coordinator's,
    so both rank a layer-indexed flow the same way; the job's end removes both entries."""
    agent = Agent(AgentConfig(node="n1", socket_path="unused", metrics_port=None))
    agent.registry = FlowRegistry(node="n1", links=("n1:tx",), id_prefix=1)
    agent.job_progress("job-7", 41, 12, owner=1000)
    assert agent.registry.job_index == {"1000/job-7": 41, "1000/job-7/layer": 12}
    agent.job_progress("job-7", 42, None, owner=1000, done=True)
    assert agent.registry.job_index == {}
