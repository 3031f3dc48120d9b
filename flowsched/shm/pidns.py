"""Find the process behind a flow-table slot whose owner lives in another pid namespace.

The plugin writes ``getpid()`` into its slot, and with it the inode of its own pid namespace
(``pid_ns``). A job in a pid namespace of its own (a Kubernetes pod without ``hostPID``) thus
writes a pid the agent cannot use as it is: the agent, in the host's namespace, finds the
process through ``/proc``, where ``/proc/<pid>/ns/pid`` names each process's namespace
(``pid:[inode]``) and the last field of the ``NSpid:`` line of ``/proc/<pid>/status`` is its pid
in that namespace.

:meth:`PidNamespaces.local_pid` (the reaper's question: does the owner live?) answers one of
three ways: the pid here; None, the process is gone; or :data:`UNKNOWN`. A miss is only "gone"
when a scan of ``/proc`` that began after the slot was claimed did not find it, and no process
the scan could not place (reading another process's namespace link needs ptrace read access:
``CAP_SYS_PTRACE``, or the same uid and gid and every capability it holds) has that pid in its
namespace; otherwise it is unknown, and the agent keeps the slot. A scan runs at most every
:data:`MIN_SCAN_INTERVAL`, and only for an owner claimed after the last one began: a table
writer forging claims cannot make it run more.

Linking needs no scan: :meth:`PidNamespaces.process_key` names a slot's owner by its
namespace and pid, and :meth:`PidNamespaces.key_of` names an SDK client (whose ``SO_PEERCRED``
pid is one of ours) the same way from its own /proc entry.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: :meth:`PidNamespaces.local_pid`'s answer when /proc cannot tell whether the owner lives
UNKNOWN = -1
#: seconds between two /proc scans at least
MIN_SCAN_INTERVAL = 0.5


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
        last = self._scan_started_ns
        if last is None or since_ns == 0 or last < since_ns:
            if last is not None and self._clock_ns() - last < MIN_SCAN_INTERVAL * 1e9:
                return UNKNOWN  # judged again at a later pass
            self._scan()
        if key in self._found:
            return self._found[key]
        return UNKNOWN if self._unplaced is None or pid in self._unplaced else None

    def process_key(self, ns: int, pid: int) -> int:
        """One number per process whichever namespace names it: ``pid`` itself for a process
        of ours (or of an unknown namespace), ``ns << 32 | pid`` for one of another (a
        namespace inode is 32 bits, so the two never meet)."""
        return (ns << 32) | pid if self.foreign(ns) else pid

    def key_of(self, pid: int) -> int:
        """:meth:`process_key` of our process ``pid`` (an SDK client's ``SO_PEERCRED`` pid):
        ``pid`` when it is in our namespace or /proc does not say."""
        if self.own == 0:
            return pid
        entry = self._entry(str(pid))
        if entry is None:
            return pid
        ns, pids = entry
        if ns is None or not self.foreign(ns):
            return pid
        return self.process_key(ns, pids[-1]) if len(pids) > 1 and pids[0] == pid else pid

    def _entry(self, name: str) -> tuple[int | None, tuple[int, ...]] | None:
        """What /proc/<name> says: (its namespace's inode, None when the link is unreadable;
        its NSpid pids, () when the status file is unreadable or the process is in our
        namespace, which settles it without reading the file); None when it is gone."""
        try:
            ns: int | None = namespace_inode(os.readlink(f"{self._proc}/{name}/ns/pid"))
        except PermissionError:
            ns = None
        except OSError:
            return None
        if ns == self.own:
            return ns, ()
        try:
            with open(f"{self._proc}/{name}/status", "rb") as status:
                return ns, nspids(status.read())
        except PermissionError:
            return ns, ()
        except OSError:
            return None

    def _still(self, here: int, key: tuple[int, int]) -> bool:
        """Whether process ``here`` is still the one found for ``key`` (not gone, nor its pid
        reused)."""
        entry = self._entry(str(here))
        if entry is None:
            return False
        ns, pids = entry
        if not pids and ns != self.own:
            return True  # it exists, and its unreadable status says nothing else
        if ns is None:
            ns = key[0]  # placed before, unreadable now (its owner changed uid): the pid decides
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
            entry = self._entry(name) if name.isdigit() else None
            if entry is None or len(entry[1]) < 2:
                continue  # gone, in our namespace, or no NSpid line to place it by
            ns, pids = entry
            if ns is None:
                unplaced.add(pids[-1])
            else:
                found[(ns, pids[-1])] = int(name)
        self._found, self._unplaced = found, unplaced
