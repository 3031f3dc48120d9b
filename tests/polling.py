"""TEST SUPPORT: wait on a condition, never on a fixed sleep."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    """Poll ``predicate`` every 10 ms until it is true (AssertionError after ``timeout`` s)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def child_exit_code(child: int, timeout: float = 10.0) -> int:
    """Forked ``child``'s exit code once it has exited; killed (-9) if it has not within
    ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid == child:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(child, signal.SIGKILL)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
