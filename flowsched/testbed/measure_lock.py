"""The machine-wide measurement lock that keeps timing-sensitive runs from overlapping."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

#: the same file ``flock /tmp/flowsched-measure.lock CMD`` takes from a shell
LOCK_PATH = Path("/tmp/flowsched-measure.lock")


@contextlib.contextmanager
def measurement_lock(enabled: bool = True) -> Iterator[None]:
    """Hold :data:`LOCK_PATH` exclusively (blocks while someone else measures); a no-op when
    ``enabled`` is false or a process this one descends from holds it (``flock FILE CMD``
    around the run: waiting would wait on our own caller)."""
    if not enabled or held_by_an_ancestor():
        yield
        return
    with LOCK_PATH.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def held_by_an_ancestor(path: Path = LOCK_PATH) -> bool:
    """Whether a process this one descends from holds a lock on ``path``, shared or exclusive,
    as ``/proc/locks`` lists them (False where there is no such file)."""
    try:
        status = path.stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return False
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    holders = set()
    for line in locks.splitlines():
        fields = line.split()  # "1: FLOCK ADVISORY READ <pid> <maj:min:inode> 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
            holders.add(int(fields[4]))
    return bool(holders) and not holders.isdisjoint(_ancestors())


def _ancestors() -> set[int]:
    """This process's parent, its parent's parent, ... up to init."""
    found: set[int] = set()
    pid = os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after "(comm) state"
    return found
