"""Closing what SDK clients handed the agent, off the event loop.

A client can pass descriptors (``SCM_RIGHTS``) with any frame it sends. Closing the last
reference to one can block the closing thread: a TCP socket with ``SO_LINGER`` set and unsent
data blocks ``close()`` for up to its linger time whatever ``O_NONBLOCK`` says, a file on a
FUSE mount waits for its daemon's flush. The agent's loop thread must therefore never hold
the last reference to such a descriptor: neither to one it received, nor to a client socket
whose receive queue may still hold some (closing it releases them). Those are handed to the
one long-lived thread of a :class:`DescriptorCloser`, which closes them in order.

The closer can be held up (for as long as a lingering socket's owner chose); what waits for it
is counted, per uid and in total, so that the SDK server stops taking more (new connections,
reads of the uid's connections) while too many of a user's descriptors wait, and the agent's
descriptor table cannot fill up.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, deque

log = logging.getLogger("flowsched.agent.sdk")


class DescriptorCloser:
    """Closes descriptors in a thread of its own (started when there is one to close),
    counting those that wait per owner (a uid, or None)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, int | None]] = deque()
        self._ready = threading.Condition()
        self._waiting: Counter[int | None] = Counter()
        self._total = 0
        self._thread: threading.Thread | None = None
        self._stopping = False

    # The two reads below take no lock: the SDK server asks them before every read and every
    # accept, and a single int or dict lookup is atomic under the GIL (the counts are only
    # written under the lock).
    @property
    def waiting(self) -> int:
        """Descriptors handed over and not closed yet, every owner's together."""
        return self._total

    def waiting_of(self, owner: int | None) -> int:
        """Descriptors of ``owner`` handed over and not closed yet."""
        return self._waiting.get(owner, 0)

    def close_later(self, fds: list[int] | tuple[int, ...], owner: int | None) -> None:
        """Close ``fds``: they are the closer's from now on (never blocks)."""
        if not fds:
            return
        with self._ready:
            self._queue.extend((fd, owner) for fd in fds)
            self._waiting[owner] += len(fds)
            self._total += len(fds)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="flowsched-closer", daemon=True
                )
                self._thread.start()
            self._ready.notify()

    def stop(self, timeout: float) -> None:
        """Let the thread close what waits and end, waiting ``timeout`` seconds at most for it
        (a close held up longer goes on in the daemon thread)."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._stopping:
                    self._ready.wait()
                if not self._queue:  # stopping, and nothing left: a later one starts anew
                    self._thread = None
                    self._stopping = False
                    return
                fd, owner = self._queue.popleft()
            try:
                os.close(fd)  # may block: that is why it is done here
            except OSError as exc:
                log.debug("closing descriptor %d: %s", fd, exc)
            with self._ready:
                self._total -= 1
                self._waiting[owner] -= 1
                if self._waiting[owner] <= 0:
                    del self._waiting[owner]
