"""CPU time and memory of a process from /proc (Linux), for the benchmarks' own accounting."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path


def cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of process ``pid`` (None once it has exited)."""
    try:
        # the command name in field 2 may contain spaces and parentheses: split after its ")"
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def running_cpu_seconds(pid: int) -> float:
    """:func:`cpu_seconds` of a process that must still run (ProcessLookupError if not)."""
    value = cpu_seconds(pid)
    if value is None:
        raise ProcessLookupError(f"process {pid} has exited")
    return value


def memory_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of process ``pid`` (NaN for a value /proc does not give)."""
    status = Path(f"/proc/{pid}/status").read_text()
    values = []
    for key in ("VmRSS", "VmHWM"):
        found = re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE)
        values.append(int(found[1]) / 1024 if found else float("nan"))
    return values[0], values[1]


def cpu_times() -> list[int]:
    """The machine's CPU time so far per state (/proc/stat: user nice system idle iowait irq
    softirq steal ...), in clock ticks; [] where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            return [int(field) for field in stat.readline().split()[1:]]
    except OSError:
        return []


def steal_share(before: list[int], after: list[int]) -> float:
    """Share of the machine's CPU time between two ``cpu_times()`` that the hypervisor gave to
    others (steal): time a virtual CPU was runnable and did not run. Wall-clock latencies
    include it; the coordinator's own CPU time does not. NaN where not reported."""
    if len(before) < 8 or len(after) < 8:
        return math.nan
    # the first 8 states: guest and guest_nice after them are already in user and nice
    spent = [now - then for then, now in zip(before[:8], after[:8], strict=True)]
    return spent[7] / sum(spent) if sum(spent) > 0 else math.nan
