"""Job names at the coordinator: bounded per node, forgotten with age or with their node."""

from __future__ import annotations

import asyncio
import time

import pytest
from coordinator_helpers import DeadlineStepPolicy, connect_as, running_coordinator, wait_until

from flowsched.coordinator import Coordinator, service
from flowsched.model import FlowClass
from flowsched.protocol import JOB_END_VERSION, FlowOpen, Flows, JobProgress


@pytest.mark.asyncio
async def test_job_names_are_bounded_per_node_and_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "MAX_JOBS_PER_NODE", 50)
    async with running_coordinator() as coordinator:
        link, other = await connect_as(coordinator, "n1"), await connect_as(coordinator, "n2")
        try:
            await other.send(JobProgress("shared", 3, 1))
            for i in range(80):
                await link.send(JobProgress(f"job-{i}", i, None))
            await link.send(JobProgress("shared", 4, None))
            await _reports_received(coordinator, 82)
            index = coordinator.state.job_index
            assert coordinator.job_count == 50  # n1's newest 50, "shared" among them
            assert "job-0" not in index and "job-79" in index and index["shared"] == 4
            coordinator._expire_jobs(time.monotonic() + 1)  # everything is older than that
            assert coordinator.job_count == 0
            assert not any(k.startswith(("job-", "shared")) for k in index)
        finally:
            await link.close()
            await other.close()


@pytest.mark.asyncio
async def test_a_job_that_ended_is_forgotten_by_every_node_at_once() -> None:
    async with running_coordinator() as coordinator:
        link, other = await connect_as(coordinator, "n1"), await connect_as(coordinator, "n2")
        try:
            assert link.version >= JOB_END_VERSION
            await other.send(JobProgress("batch", 3, 3))
            await link.send(JobProgress("batch", 7, 7))
            await link.send(JobProgress("kept", 1, None))
            await _reports_received(coordinator, 3)
            assert coordinator.state.job_index["batch/layer"] == 7
            await link.send(JobProgress("batch", 8, None, done=True))
            await _reports_received(coordinator, 4)
            index = coordinator.state.job_index
            assert "batch" not in index and "batch/layer" not in index and index["kept"] == 1
            assert coordinator.job_count == 1  # n2's record of "batch" went too
        finally:
            await link.close()
            await other.close()


@pytest.mark.asyncio
async def test_a_job_no_node_reports_any_more_expires_without_further_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An agent before protocol 4 never says that a job ended: the TTL is what forgets it,
    # also when no job progress at all comes after its last report.
    monkeypatch.setattr(service, "JOB_TTL", 0.3)
    policy = DeadlineStepPolicy()  # promotion timers: no timer sweep re-evaluates the flow
    async with running_coordinator(idle_timeout=30.0, policy_factory=lambda: policy) as coordinator:
        link = await connect_as(coordinator, "n1")
        try:
            await link.send(
                Flows(opens=(FlowOpen(1, FlowClass.KV, time.time(), job="last-batch"),))
            )
            await link.send(JobProgress("last-batch", 5, 2))
            await _reports_received(coordinator, 1)
            assert coordinator.job_count == 1
            await wait_until(lambda: policy.seen, 3.0, "the flow's first evaluation")
            policy.seen.clear()
            await wait_until(lambda: coordinator.job_count == 0, 3.0, "the job to expire")
            assert "last-batch" not in coordinator.state.job_index
            assert "last-batch/layer" not in coordinator.state.job_index
            await wait_until(lambda: policy.seen, 3.0, "the job's flow to be re-evaluated")
        finally:
            await link.close()


@pytest.mark.asyncio
async def test_a_job_forgotten_with_its_node_has_its_flows_on_other_nodes_re_evaluated() -> None:
    policy = DeadlineStepPolicy()  # promotion timers: no timer sweep re-evaluates the flow
    async with running_coordinator(
        grace_period=0.2, idle_timeout=30.0, policy_factory=lambda: policy
    ) as coordinator:
        reporter, other = await connect_as(coordinator, "n1"), await connect_as(coordinator, "n2")
        try:
            await other.send(Flows(opens=(FlowOpen(1, FlowClass.KV, time.time(), job="batch"),)))
            await reporter.send(JobProgress("batch", 5, 2))
            await _reports_received(coordinator, 1)
            await wait_until(lambda: policy.seen, 3.0, "the flow's first evaluation")
            policy.seen.clear()
            await reporter.close()  # n1 goes for good: after the grace period, "batch" with it
            await wait_until(lambda: coordinator.job_count == 0, 3.0, "the job to be forgotten")
            assert "batch" not in coordinator.state.job_index
            await wait_until(lambda: policy.seen, 3.0, "n2's flow of the job to be re-evaluated")
        finally:
            await reporter.close()
            await other.close()


async def _reports_received(coordinator: Coordinator, count: int) -> None:
    """Wait until the coordinator has handled ``count`` job_progress frames."""
    events = coordinator.state.stats.events
    deadline = time.monotonic() + 5
    while events["job_progress"] < count:
        assert time.monotonic() < deadline, f"the coordinator got {events['job_progress']} reports"
        await asyncio.sleep(0.01)
