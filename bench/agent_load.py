"""Agent load: table scan cost at N active plugin connections, and a live agent's CPU and memory.

    .venv/bin/python bench/agent_load.py [--slots 1000] [--seconds 5]

Part 1 (in process) times one agent scan (``FlowTable.slots()`` + ``FlowRegistry.observe``) of a
table with N ACTIVE slots whose byte counters all moved since the previous scan, next to the
baseline of merely copying the table out of shared memory and unpacking every slot with one
``struct.iter_unpack`` (the least any Python reader must do). Part 2 starts a real
``flowsched agent`` process (no coordinator: its local policy runs), claims N slots, keeps
adding bytes to all of them for ``--seconds``, and reads the agent's CPU time and resident
memory from /proc. Goal from the issue: an agent under 100 MiB.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from flowsched.agent.flows import FlowRegistry
from flowsched.shm import layout
from flowsched.shm.table import EmulatedPluginSlot, FlowTable, monotonic_ns
from flowsched.testbed.procstat import memory_mib, running_cpu_seconds


def scan_cost(num_active: int, rounds: int) -> tuple[float, float, float]:
    """Median seconds per agent scan, per progress batch, and per baseline read."""
    with tempfile.TemporaryDirectory() as tmp:
        table, _ = FlowTable.create_or_attach(f"{tmp}/table", num_slots=layout.DEFAULT_NUM_SLOTS)
        slots = [EmulatedPluginSlot(table, class_id=i % 6) for i in range(num_active)]
        registry = FlowRegistry(node="bench", links=("bench/eth0",), id_prefix=1)
        registry.observe_counts(table.busy_slots(), table.slot, time.time(), monotonic_ns())
        registry.take_batch()
        scans, batches, base = [], [], []
        slot_struct = layout.SLOT_STRUCT
        for _ in range(rounds):
            for s in slots:
                s.send(4096)
            t0 = time.perf_counter()
            registry.observe_counts(table.busy_slots(), table.slot, time.time(), monotonic_ns())
            t1 = time.perf_counter()
            registry.take_batch()
            t2 = time.perf_counter()
            raw = bytes(table._mm[layout.HEADER_SIZE :])
            sum(1 for rec in slot_struct.iter_unpack(raw) if rec[0] == layout.SLOT_ACTIVE)
            t3 = time.perf_counter()
            scans.append(t1 - t0)
            batches.append(t2 - t1)
            base.append(t3 - t2)
        del slots
        table.close()
    return statistics.median(scans), statistics.median(batches), statistics.median(base)


def live_agent(num_active: int, seconds: float) -> tuple[float, float, float]:
    """(idle CPU %, loaded CPU %, RSS MiB) of a real agent process."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "flowsched", "agent", "--node", "bench", "--table",
               f"{tmp}/table", "--socket", f"{tmp}/agent.sock", "--metrics-port", "-1",
               "--interface", "lo", "--log-level", "WARNING"]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # ready line
            time.sleep(1.0)
            c0 = running_cpu_seconds(proc.pid)
            time.sleep(seconds / 2)
            idle = (running_cpu_seconds(proc.pid) - c0) / (seconds / 2) * 100
            table = FlowTable.open(f"{tmp}/table", writable=True)
            slots = [EmulatedPluginSlot(table, class_id=i % 6) for i in range(num_active)]
            c1, t1 = running_cpu_seconds(proc.pid), time.monotonic()
            while time.monotonic() - t1 < seconds:
                for s in slots:
                    s.send(65536)
                time.sleep(0.01)
            loaded = (running_cpu_seconds(proc.pid) - c1) / (time.monotonic() - t1) * 100
            rss = memory_mib(proc.pid)[0]
            for s in slots:
                s.close()
            del slots
            table.close()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return idle, loaded, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    scan, batch, base = scan_cost(args.slots, args.rounds)
    print(f"{args.slots} active slots, all counters moved: agent scan {scan * 1e3:.2f} ms "
          f"(baseline copy+unpack of the table {base * 1e3:.2f} ms, ratio {scan / base:.1f}x); "
          f"progress batch of {args.slots} flows {batch * 1e3:.2f} ms")  # fmt: skip
    idle, loaded, rss = live_agent(args.slots, args.seconds)
    print(f"live agent (poll 5 ms): idle {idle:.1f}% CPU, {args.slots} busy slots "
          f"{loaded:.1f}% CPU, RSS {rss:.1f} MiB (goal < 100 MiB)")  # fmt: skip


if __name__ == "__main__":
    main()
