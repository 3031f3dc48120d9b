"""Find the process behind a flow-table slot whose owner lives in another pid namespace.

The plugin writes ``getpid()`` into its slot, and with it the inode of its own pid namespace
(``pid_ns``) and its start time (``start_ticks``). A job in a pid namespace of its own (a
Kubernetes pod without ``hostPID``) thus writes a pid the agent cannot use as it is: the agent,
in the host's namespace, finds the process through ``/proc``, where the last field of the
``NSpid:`` line of ``/proc/<pid>/status`` is its pid in its own namespace, ``/proc/<pid>/ns/pid``
names that namespace (``pid:[inode]``) and field 22 of ``/proc/<pid>/stat`` is its start.

Reading another process's namespace link needs ptrace read access (``CAP_SYS_PTRACE``, or the
same uid and gid and every capability it holds); ``status`` and ``stat`` are world-readable. So
an owner is placed by its namespace and pid where the link can be read, and otherwise by its pid
there and its start, to the clock tick: only two processes with the same pid in their
namespaces that started in the same tick cannot be told apart. Starts are compared as the host
counts them: /proc shows a reader in a time namespace every start shifted by its boot-time
offset, which the plugin and the agent each take off.

:meth:`PidNamespaces.local_pid` (the reaper's question: does the owner live?) answers one of
three ways: the pid here; None, the process is gone; or :data:`UNKNOWN`, and the agent keeps
the slot. A miss is only "gone" when a scan of ``/proc`` that began after the slot was claimed
did not find it, and nothing that scan could not read could be it. A scan runs at most every
:data:`MIN_SCAN_INTERVAL`, and only for an owner claimed after the last one began: a table
writer forging claims cannot make it run more.

Linking needs no scan: :meth:`PidNamespaces.process_key` names a slot's owner by its
namespace and pid, and :meth:`PidNamespaces.key_of` names an SDK client (whose ``SO_PEERCRED``
pid is one of ours) the same way, from its own /proc entry and the namespace it proves it is in
(it passes the agent a descriptor of its ``/proc/self/ns/pid``).
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


def start_ticks(stat: bytes) -> int:
    """Field 22 of a ``/proc/<pid>/stat`` text: when the process started, in clock ticks after
    boot (0 when the text has no such field). The command name, field 2, may hold anything but
    ends at the text's last ``)``."""
    fields = stat[stat.rfind(b")") + 2 :].split()  # field 3 onwards
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0


def boottime_offset_ticks(offsets: bytes, hz: int) -> int | None:
    """The ``boottime`` line of a ``/proc/<pid>/timens_offsets`` text in clock ticks: what a
    process of that time namespace adds to every start it reads in ``/proc`` (0 without the
    line); None when it is not a whole number of ticks (starts then cannot be compared)."""
    for line in offsets.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] in (b"boottime", b"7"):  # 7: CLOCK_BOOTTIME's id
            offset_ns = int(fields[1]) * 1_000_000_000 + int(fields[2])
            ticks, rest = divmod(offset_ns * hz, 1_000_000_000)
            return None if rest else ticks
    return 0


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
        try:
            with open(f"{proc}/self/timens_offsets", "rb") as offsets:
                text = offsets.read()
        except OSError:
            text = b""  # no time namespaces on this kernel
        try:
            shift = boottime_offset_ticks(text, os.sysconf("SC_CLK_TCK") or 100)
        except ValueError:
            shift = None  # unreadable offsets: starts are not compared
        #: what our reads of /proc add to every start tick (None: starts are not compared)
        self._start_shift = shift
        self._found: dict[tuple[int, int], int] = {}
        #: the start of each process found by its start (not by its namespace link)
        self._found_by_start: dict[tuple[int, int], int] = {}
        #: processes of other namespaces whose namespace the last scan could not read, by
        #: their pid there: their pids here (None: a miss is never certain, because the scan
        #: could not list /proc or found an entry it could read nothing of)
        self._unplaced: dict[int, list[int]] | None = {}
        self._scan_started_ns: int | None = None
        #: full /proc scans so far
        self.scans = 0

    def foreign(self, ns: int) -> bool:
        """Whether a slot's ``pid_ns`` names a namespace other than ours (0 = unknown: ours;
        all of them are ours when we cannot read our own)."""
        return ns != 0 and self.own != 0 and ns != self.own

    def local_pid(self, ns: int, pid: int, since_ns: int = 0, start: int = 0) -> int | None:
        """The pid here of process ``pid`` of namespace ``ns``, which existed at ``since_ns``
        (CLOCK_MONOTONIC ns, the slot's ``open_ns``; 0 = unknown) and started at ``start``
        (the slot's ``start_ticks``; 0 = unknown): ``pid`` itself when ``ns`` is ours or
        unknown, None when it is gone, :data:`UNKNOWN` when /proc cannot tell."""
        if not self.foreign(ns):
            return pid
        key = (ns, pid)
        here = self._known(key, start)
        if here is not None:
            if self._still(here, key):
                return here
            del self._found[key]
            self._found_by_start.pop(key, None)
            return None  # a process never leaves its namespace nor changes its pid there
        last = self._scan_started_ns
        if last is None or since_ns == 0 or last < since_ns:
            if last is not None and self._clock_ns() - last < MIN_SCAN_INTERVAL * 1e9:
                return UNKNOWN  # judged again at a later pass
            self._scan()
        here = self._known(key, start)
        if here is not None:
            return here
        if self._unplaced is None:
            return UNKNOWN
        others = self._unplaced.get(pid, [])
        if not (start and others and self._start_shift is not None):
            return UNKNOWN if others else None
        # the processes of that pid there that started then, or whose start cannot be read
        # (their stat files are read now, not in the scan: few processes share a pid)
        starts = {here: self._started(here) for here in others}
        candidates = [here for here, began in starts.items() if began in (start, 0)]
        if len(candidates) == 1 and starts[candidates[0]] == start:
            self._found[key] = here = candidates[0]
            self._found_by_start[key] = start
            return here
        # two processes with that pid there that started in that tick: cannot tell which
        return UNKNOWN if candidates else None

    def _known(self, key: tuple[int, int], start: int) -> int | None:
        """The process found for ``key``, unless it was placed by a start other than
        ``start`` (then the one asked about is another process of that pid there, or may be:
        0, unknown)."""
        here = self._found.get(key)
        return here if self._found_by_start.get(key, start) == start else None

    def process_key(self, ns: int, pid: int) -> int:
        """One number per process whichever namespace names it: ``pid`` itself for a process
        of ours (or of an unknown namespace), ``ns << 32 | pid`` for one of another (a
        namespace inode is 32 bits, so the two never meet)."""
        return (ns << 32) | pid if self.foreign(ns) else pid

    def key_of(self, pid: int, shown_ns: int = 0) -> int:
        """:meth:`process_key` of our process ``pid`` (an SDK client's ``SO_PEERCRED`` pid):
        ``pid`` when it is in our namespace or /proc does not say. ``shown_ns``: the pid
        namespace it showed a descriptor of (0 = none), taken where its link cannot be read
        (it could open only its own namespace or one nested in it: docs/security.md)."""
        return self.client_key(pid, shown_ns)[0]

    def hidden(self, pid: int) -> bool:
        """Whether our process ``pid`` lives in another pid namespace that /proc does not name
        to us (its link is unreadable): :meth:`key_of` cannot place it without ``shown_ns``."""
        return self.client_key(pid)[1]

    def client_key(self, pid: int, shown_ns: int = 0) -> tuple[int, bool]:
        """(:meth:`key_of`, whether the process is :meth:`hidden` and showed no namespace)
        from one read of its /proc entry."""
        entry = self._entry(str(pid)) if self.own else None
        if entry is None:
            return pid, False
        ns, pids = entry
        nested = len(pids) > 1 and pids[0] == pid
        if ns is None and not shown_ns:
            return pid, nested
        ns = shown_ns if ns is None else ns
        return (self.process_key(ns, pids[-1]) if nested and self.foreign(ns) else pid), False

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
        status = self._read(name, "status")
        return None if status is None else (ns, nspids(status))

    def _read(self, name: str, file: str) -> bytes | None:
        """/proc/<name>/<file>: b"" when it is unreadable, None when the process is gone."""
        try:
            with open(f"{self._proc}/{name}/{file}", "rb") as f:
                return f.read()
        except PermissionError:
            return b""
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
            ns = key[0]  # placed by its start, or its owner changed uid since: the pid decides
        return len(pids) > 1 and (ns, pids[-1]) == key

    def _scan(self) -> None:
        """Place every process of a namespace nested in ours (one /proc pass)."""
        self._scan_started_ns = self._clock_ns()
        self.scans += 1
        found: dict[tuple[int, int], int] = {}
        unplaced: dict[int, list[int]] = {}
        try:
            names = os.listdir(self._proc)
            certain = True
        except OSError:
            names, certain = [], False
        for name in names:
            entry = self._entry(name) if name.isdigit() else None
            if entry is None:
                continue  # gone
            ns, pids = entry
            if not pids and ns != self.own:
                certain = False  # its pids cannot be read: it could be anyone's owner
            elif len(pids) < 2:
                continue  # in our namespace, or no NSpid line to place it by
            elif ns is not None:
                found[(ns, pids[-1])] = int(name)
            else:
                unplaced.setdefault(pids[-1], []).append(int(name))
        self._found, self._found_by_start = found, {}
        self._unplaced = unplaced if certain else None

    def start_of(self, name: int | str) -> int:
        """When process ``name`` (of ours) started, in clock ticks after boot as the host counts
        them (the slot's ``start_ticks``); 0 when unknown."""
        return self._started(name) or 0

    def _started(self, name: int | str) -> int | None:
        """:meth:`start_of`, but None when the process is gone."""
        stat = self._read(str(name), "stat")
        if stat is None:
            return None
        ticks = start_ticks(stat)
        return ticks - self._start_shift if ticks and self._start_shift is not None else 0
