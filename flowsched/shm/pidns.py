"""Find the process behind a flow-table slot whose owner lives in another pid namespace.

The plugin writes ``getpid()`` into its slot, and with it the inode of its own pid namespace
(``pid_ns``). A job in a pid namespace of its own (a Kubernetes pod without ``hostPID``) thus
writes a pid the agent cannot use as it is: the agent, in the host's namespace, finds the
process through ``/proc``, where ``/proc/<pid>/ns/pid`` names each process's namespace
(``pid:[inode]``) and the last field of the ``NSpid:`` line of ``/proc/<pid>/status`` is its pid
in that namespace.

:meth:`PidNamespaces.local_pid` answers one of three ways: the pid here; None, the process is
gone; or :data:`UNKNOWN`. A miss is only "gone" when a scan of ``/proc`` that began after the
slot was claimed did not find it, and no process the scan could not place (reading another
user's namespace link needs ptrace read access: the same uid, or ``CAP_SYS_PTRACE``) has that
pid in its namespace; otherwise it is unknown, and the agent keeps the slot. So a full scan runs
at most once per batch of new owners, and never to confirm what an earlier scan already saw.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: :meth:`PidNamespaces.local_pid`'s answer when /proc cannot tell whether the owner lives
UNKNOWN = -1


def namespace_inode(link: str) -> int:
    """The inode in a ``pid:[4026531836]`` namespace link, 0 when it is not one."""
    if link.startswith("pid:[") and link.endswith("]") and link[5:-1].isdigit():
        return int(link[5:-1])
    return 0


def nspids(status: bytes) -> tuple[int, ...]:
    """The pids of the ``NSpid:`` line of a ``/proc/<pid>/status`` text: the process's pid in
    the reader's namespace first, in its own namespace last; () without one."""
    start = status.find(b"\nNSpid:")
    if start < 0:
        return ()
    end = status.find(b"\n", start + 7)
    fields = status[start + 7 : end if end >= 0 else None].split()
    return tuple(int(f) for f in fields) if all(f.isdigit() for f in fields) else ()


class PidNamespaces:
    """Maps ``(pid namespace inode, pid there)`` to a pid of the caller's namespace."""

    def __init__(
        self, proc: str = "/proc", clock_ns: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self._proc = proc
        self._clock_ns = clock_ns
        try:
            self.own = namespace_inode(os.readlink(f"{proc}/self/ns/pid"))
        except OSError:
            self.own = 0
        self._found: dict[tuple[int, int], int] = {}
        #: innermost pids of the processes the last scan could not place in a namespace
        #: (None: the scan could not list /proc, so no miss is certain)
        self._unplaced: set[int] | None = set()
        self._scan_started_ns: int | None = None
        #: full /proc scans so far
        self.scans = 0

    def foreign(self, ns: int) -> bool:
        """Whether a slot's ``pid_ns`` names a namespace other than ours (0 = unknown: ours;
        all of them are ours when we cannot read our own)."""
        return ns != 0 and self.own != 0 and ns != self.own

    def local_pid(self, ns: int, pid: int, since_ns: int = 0) -> int | None:
        """The pid here of process ``pid`` of namespace ``ns``, which existed at ``since_ns``
        (CLOCK_MONOTONIC ns, the slot's ``open_ns``; 0 = unknown): ``pid`` itself when ``ns``
        is ours or unknown, None when it is gone, :data:`UNKNOWN` when /proc cannot tell."""
        if not self.foreign(ns):
            return pid
        key = (ns, pid)
        here = self._found.get(key)
        if here is not None:
            if self._still(here, key):
                return here
            del self._found[key]
            return None  # a process never leaves its namespace nor changes its pid there
        if self._scan_started_ns is None or since_ns == 0 or self._scan_started_ns < since_ns:
            self._scan()
        if key in self._found:
            return self._found[key]
        return UNKNOWN if self._unplaced is None or pid in self._unplaced else None

    def _still(self, here: int, key: tuple[int, int]) -> bool:
        """Whether process ``here`` is still the one found for ``key`` (not gone, nor its pid
        reused)."""
        try:
            with open(f"{self._proc}/{here}/status", "rb") as status:
                pids = nspids(status.read())
            ns = namespace_inode(os.readlink(f"{self._proc}/{here}/ns/pid"))
        except PermissionError:
            ns = key[0]  # placed before, unreadable now (its owner changed uid): the pid decides
        except OSError:
            return False
        return len(pids) > 1 and (ns, pids[-1]) == key

    def _scan(self) -> None:
        """Place every process of a namespace nested in ours (one /proc pass)."""
        self._scan_started_ns = self._clock_ns()
        self.scans += 1
        found: dict[tuple[int, int], int] = {}
        unplaced: set[int] = set()
        try:
            names = os.listdir(self._proc)
        except OSError:
            self._found, self._unplaced = found, None
            return
        for name in names:
            if not name.isdigit():
                continue
            try:  # the link first: one system call settles every process of our namespace
                ns = namespace_inode(os.readlink(f"{self._proc}/{name}/ns/pid"))
            except PermissionError:
                ns = None
            except OSError:
                continue  # gone since the listing
            if ns == self.own:
                continue
            try:
                with open(f"{self._proc}/{name}/status", "rb") as status:
                    pids = nspids(status.read())
            except OSError:
                continue
            if len(pids) < 2:
                continue  # in our namespace after all, or no NSpid line
            if ns is None:
                unplaced.add(pids[-1])
            else:
                found[(ns, pids[-1])] = int(name)
        self._found, self._unplaced = found, unplaced
