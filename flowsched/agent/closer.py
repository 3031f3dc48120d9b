"""Closing what SDK clients handed the agent, off the event loop.

A client can pass descriptors (``SCM_RIGHTS``) with any frame it sends. Closing the last
reference to one can block the closing thread: a TCP socket with ``SO_LINGER`` set and unsent
data blocks ``close()`` for up to its linger time whatever ``O_NONBLOCK`` says, a file on a
FUSE mount waits for its daemon's flush. The agent's loop thread must therefore never hold
the last reference to such a descriptor: neither to one it received, nor to a client socket
whose receive queue may still hold some (closing it releases them). Those are handed to a
:class:`DescriptorCloser`, which closes each owner's (a uid's, or the agent's own) in order in
a thread of that owner's: one user's lingering socket holds up that user's closes only. The
thread starts when the owner has descriptors to close and ends when it has none left.

A close can be held up for as long as the descriptor's owner chose; what waits is counted,
per uid and in total, so that the SDK server stops taking more (new connections, reads of the
uid's connections) while too many of a user's descriptors wait, and the agent's descriptor
table cannot fill up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque

from flowsched.lograte import RepeatLog

log = logging.getLogger("flowsched.agent.sdk")

# How many threads: one per owner with descriptors waiting, so no more than the descriptors
# waiting, nor than the uids that may connect (the socket's user, its group's members, root)
# and None. The SDK server bounds the first whatever the group's size: it accepts a connection
# only while fewer than MAX_UNCLOSED descriptors wait (so fewer owners have a thread then), and
# an owner's first descriptor comes with a connection of its uid (the socket, or one passed
# over it). So at most MAX_UNCLOSED + 1 + the connections it holds at once: max_connections
# served, and those accepted but not refused yet (each refusal hands its socket over at once).


class DescriptorCloser:
    """Closes descriptors in a thread per owner (a uid, or None), counting those that wait."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: each owner's descriptors its thread has not taken yet; an owner has an entry from
        #: its first hand-over until its thread finds the queue empty
        self._queues: dict[int | None, deque[int]] = {}
        self._threads: dict[int | None, threading.Thread] = {}
        #: owners with an entry in ``_queues`` and no thread yet
        self._unstarted: set[int | None] = set()
        self._waiting: Counter[int | None] = Counter()
        self._total = 0
        self._repeat_log = RepeatLog(log)

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
        """Close ``fds`` after ``owner``'s earlier ones: they are the closer's from now on
        (never blocks)."""
        if not fds:
            return
        with self._lock:
            if owner not in self._queues:
                self._queues[owner] = deque()
                self._unstarted.add(owner)
            self._queues[owner].extend(fds)
            self._waiting[owner] += len(fds)
            self._total += len(fds)
            self._start_threads()

    def stop(self, timeout: float) -> None:
        """Wait ``timeout`` seconds at most, all owners together, for what waits to be closed
        (a close held up longer goes on in its owner's daemon thread)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                running = list(self._threads.values())
            left = deadline - time.monotonic()
            if not running or left <= 0:
                return
            running[0].join(left)

    def _start_threads(self) -> None:
        """Start a thread for each owner whose descriptors have none (called with the lock
        held). One that cannot be started (the process is out of threads) is tried again at
        the next hand-over or a thread's end; meanwhile its owner's descriptors wait."""
        for owner in list(self._unstarted):
            thread = threading.Thread(
                target=self._run, args=(owner,), name=f"flowsched-closer-{owner}", daemon=True
            )
            try:
                thread.start()
            except RuntimeError as exc:
                self._repeat_log.log(
                    "no_thread", logging.WARNING,
                    "cannot start a thread to close descriptors of uid %s: %s", owner, exc,
                )  # fmt: skip
                return
            self._threads[owner] = thread
            self._unstarted.discard(owner)

    def _run(self, owner: int | None) -> None:
        """Close ``owner``'s descriptors in order until none is left, then end."""
        while True:
            with self._lock:
                queue = self._queues[owner]
                if not queue:
                    del self._queues[owner], self._threads[owner]
                    self._start_threads()  # for an owner whose thread could not start
                    return
                fd = queue.popleft()
            try:
                os.close(fd)  # may block: that is why it is done here
            except OSError as exc:
                log.debug("closing descriptor %d: %s", fd, exc)
            with self._lock:
                self._total -= 1
                self._waiting[owner] -= 1
                if self._waiting[owner] <= 0:
                    del self._waiting[owner]
