"""Time zero of a contention testbed run, handed out once every process that needs it is ready.

The runner (:mod:`flowsched.testbed.runner`) starts the processes that keep the run's clock,
one worker per host and, for ``--control mini``, the minimal controller, with stdin and stdout
on pipes. Each does its slow setup, prints its ready line as its first stdout line, then waits
for one line on stdin: ``{"t0_ns": N, "t0_wall": S}``, time zero on CLOCK_MONOTONIC (which
every network namespace of the machine shares) and on the wall clock (the SDK takes deadlines
as wall-clock times). The runner sends it once every worker is ready, a short margin ahead
(``runner.START_MARGIN``), so that no trace time passes while a process is still starting.

A process that gets no line within :data:`START_WAIT`, or whose stdin ends first (the runner
died), gives up with :class:`NoTimeZero` instead of waiting for ever.
"""

from __future__ import annotations

import json
import os
import select
import time
from dataclasses import dataclass

#: a worker's first stdout line once it can act at time zero
READY = b"ready"
#: seconds a process waits for time zero after its ready line. Longer than the runner waits for
#: everything it starts after the minimal controller (the sniffer's and the workers' ready
#: lines, ``runner.READY_TIMEOUT`` each), so only a runner that hangs runs into it
START_WAIT = 120.0
#: bytes of the time-zero line a process reads at most (the line is ~50)
MAX_LINE = 4096


class NoTimeZero(RuntimeError):
    """Time zero never came: the runner sent nothing in time, closed the pipe, or sent a line
    that is not a time zero."""


@dataclass(frozen=True, slots=True)
class TimeZero:
    """The run's time zero: ``ns`` on CLOCK_MONOTONIC, ``wall`` on the wall clock."""

    ns: int
    wall: float

    @classmethod
    def after(cls, delay: float) -> TimeZero:
        """The instant ``delay`` seconds from now."""
        return cls(time.monotonic_ns() + round(delay * 1e9), time.time() + delay)

    def line(self) -> bytes:
        """The line the runner sends."""
        return json.dumps({"t0_ns": self.ns, "t0_wall": self.wall}).encode() + b"\n"

    @classmethod
    def parse(cls, raw: bytes) -> TimeZero:
        """The time zero of one line; :class:`NoTimeZero` naming the bad field."""
        try:
            fields = json.loads(raw)
        except ValueError:
            raise NoTimeZero(f"time zero: not a JSON line: {raw[:80]!r}") from None
        if not isinstance(fields, dict):
            raise NoTimeZero(f"time zero: expected an object, got {raw[:80]!r}")
        ns, wall = fields.get("t0_ns"), fields.get("t0_wall")
        if isinstance(ns, bool) or not isinstance(ns, int):
            raise NoTimeZero(f"time zero: t0_ns: expected an integer, got {ns!r}")
        if isinstance(wall, bool) or not isinstance(wall, int | float):
            raise NoTimeZero(f"time zero: t0_wall: expected a number, got {wall!r}")
        return cls(ns, float(wall))


def announce_ready() -> None:
    """Print the ready line (:data:`READY`) on stdout, at once."""
    print(READY.decode(), flush=True)


def wait(fd: int = 0, timeout: float | None = None) -> TimeZero:
    """Read the time zero line from ``fd`` (stdin), waiting at most ``timeout`` seconds
    (default :data:`START_WAIT`); :class:`NoTimeZero` saying why when none comes."""
    timeout = START_WAIT if timeout is None else timeout
    deadline = time.monotonic() + timeout
    line = b""
    while b"\n" not in line:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise NoTimeZero(f"no time zero within {timeout:g} s")
        chunk = os.read(fd, MAX_LINE - len(line))
        if not chunk:
            raise NoTimeZero("stdin ended before time zero came (the runner is gone)")
        line += chunk
        if len(line) >= MAX_LINE and b"\n" not in line:
            raise NoTimeZero(f"time zero: a line longer than {MAX_LINE} bytes")
    return TimeZero.parse(line.split(b"\n", 1)[0])
