"""Ending a job process of the plugin tests: one that waits for a line on its stdin."""

from __future__ import annotations

import subprocess

from polling import wait_until

from flowsched.shm import layout
from flowsched.shm.table import FlowTable


def end_job(job: subprocess.Popen[str], table: FlowTable) -> None:
    """Tell ``job`` to finish, check that it exited cleanly, and wait until the agent freed
    every slot of ``table`` (the job's connections closed or reaped)."""
    assert job.stdin is not None
    job.stdin.write("\n")
    job.stdin.flush()
    assert job.wait(timeout=10) == 0
    wait_until(lambda: all(s.state == layout.SLOT_FREE for s in table.slots()))
