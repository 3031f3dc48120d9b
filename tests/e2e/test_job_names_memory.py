"""200,000 job names from one SDK client: the agent's and the coordinator's memory stay flat.

Real ``flowsched coordinator`` and ``flowsched agent`` processes; resident memory from
``/proc/<pid>/status`` before and after (the issue measured +95 MB agent, +75 MB coordinator,
and every name was resent after each reconnect). Figures are printed (``-s``).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from e2e_helpers import scrape, total, wait_for
from test_preauth_floods import MIB, coordinator_and_agent, rss_bytes

from flowsched.protocol import sdk

pytestmark = pytest.mark.slow

NAMES = 200_000


def _coordinator_events(port: str) -> float:
    return total(scrape(port), "flowsched_coordinator_events_total", kind="job_progress")


def test_200k_job_names_leave_agent_and_coordinator_memory_flat(
    tmp_path: Path, token: Path
) -> None:
    frames = b"".join(sdk.encode(sdk.JobProgress(f"job-{i:06d}", i)) for i in range(NAMES))
    with coordinator_and_agent(tmp_path, token) as setup:
        agent_pid, coordinator_pid = setup.agent.proc.pid, setup.coordinator.proc.pid
        agent_before, coordinator_before = rss_bytes(agent_pid), rss_bytes(coordinator_pid)
        started = time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(setup.agent.fields["socket"])
            for start in range(0, len(frames), MIB):
                sock.sendall(frames[start : start + MIB])
            wait_for(
                lambda: (
                    total(
                        scrape(setup.agent.fields["mport"]),
                        "flowsched_agent_sdk_requests_total",
                        type="job_progress",
                    )
                    >= NAMES
                ),
                120,
                "the agent to read every job_progress",
            )
        mport = setup.coordinator.fields["mport"]
        seen: list[float] = [-1.0]

        def settled() -> bool:  # two scrapes 0.3 s apart agree: the agent has sent its last
            now = _coordinator_events(mport)
            done = now == seen[-1] and now > 0
            seen.append(now)
            return done

        wait_for(settled, 60, "the coordinator to take the last job reports", interval=0.3)
        elapsed = time.monotonic() - started
        agent_after, coordinator_after = rss_bytes(agent_pid), rss_bytes(coordinator_pid)
    agent_growth, coordinator_growth = (
        agent_after - agent_before,
        coordinator_after - coordinator_before,
    )
    print(
        f"\n{NAMES} job names in {elapsed:.1f} s: agent RSS {agent_before / MIB:.1f} -> "
        f"{agent_after / MIB:.1f} MiB (+{agent_growth / MIB:.1f}), coordinator RSS "
        f"{coordinator_before / MIB:.1f} -> {coordinator_after / MIB:.1f} MiB "
        f"(+{coordinator_growth / MIB:.1f}); the coordinator got {seen[-1]:.0f} job reports"
    )
    assert agent_growth < 20 * MIB  # unbounded: +95 MB
    assert coordinator_growth < 20 * MIB  # unbounded: +75 MB
