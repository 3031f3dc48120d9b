"""Job processes of the plugin tests: one that sends through the plugin until a line arrives on
its stdin, and ending it."""

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


#: a job process: one pair of connections through the plugin (argv[1]) that sends 100 kB,
#: prints its pid, then sends 1 kB messages until a line arrives on its stdin
SENDING_JOB = """
import os, select, sys
from flowsched.nccl.harness import Plugin, connect_pair, loopback_message
plugin = Plugin(sys.argv[1], 11)
ctx = plugin.init(comm_id=0x99, traffic_class=-1)
send, recv = connect_pair(ctx)
loopback_message(send, recv, b"x" * 100_000, tag=1)
print(os.getpid(), flush=True)
while not select.select([sys.stdin], [], [], 0.01)[0]:  # a training loop's messages
    loopback_message(send, recv, b"y" * 1000, tag=1)
send.close()
recv.close()
ctx.finalize()
plugin.close()
"""


def applied(table: FlowTable, index: int) -> bool:
    """Slot ``index`` holds a level from the agent, and the plugin applies it."""
    snap = table.slot(index)
    return (
        snap is not None and snap.level != layout.LEVEL_UNSET and snap.applied_level == snap.level
    )
