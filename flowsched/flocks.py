"""Waiting for an exclusive ``flock`` with a deadline (the daemons and the CLI never wait for a
lock without one)."""

from __future__ import annotations

import fcntl
import time

#: seconds between two attempts
POLL = 0.01


def lock_within(fd: int, seconds: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, waiting at most ``seconds``; False when another
    holder kept it that long (``flock(2)`` itself has no timeout, hence the polling)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL)
