"""The machine-wide measurement lock that keeps timing-sensitive runs from overlapping."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

#: the same file ``flock /tmp/flowsched-measure.lock CMD`` takes from a shell
LOCK_PATH = Path("/tmp/flowsched-measure.lock")


@contextlib.contextmanager
def measurement_lock(enabled: bool = True) -> Iterator[None]:
    """Hold :data:`LOCK_PATH` exclusively (blocks while someone else measures); a no-op when
    ``enabled`` is false (the caller already holds it, e.g. under ``flock``)."""
    if not enabled:
        yield
        return
    with LOCK_PATH.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
