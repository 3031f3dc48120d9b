"""The start barrier's line: what a process waiting for time zero accepts, and when it gives up."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest

from flowsched.testbed import runner, timezero
from flowsched.testbed.timezero import NoTimeZero, TimeZero

ZERO = TimeZero(123_456_789_000, 1_700_000_000.25)


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    """(read end, write end) of a pipe; both closed after the test (the write end may be)."""
    read, write = os.pipe()
    yield read, write
    os.close(read)
    with contextlib.suppress(OSError):  # the test closed it
        os.close(write)


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([ZERO.line()], ZERO),
        ([ZERO.line()[:10], ZERO.line()[10:]], ZERO),
        ([b'{"t0_ns": 5, "t0_wall": 7}\n'], TimeZero(5, 7.0)),
        ([b"not json\n"], "time zero: not a JSON line: b'not json'"),
        ([b"[1, 2]\n"], "time zero: expected an object, got b'[1, 2]'"),
        ([b'{"t0_wall": 1.5}\n'], "time zero: t0_ns: expected an integer, got None"),
        ([b'{"t0_ns": true, "t0_wall": 1.5}\n'], "time zero: t0_ns: expected an integer, got True"),
        ([b'{"t0_ns": 5, "t0_wall": "now"}\n'], "time zero: t0_wall: expected a number, got 'now'"),
        ([b"x" * timezero.MAX_LINE], f"time zero: a line longer than {timezero.MAX_LINE} bytes"),
    ],
    ids=[
        "line", "split-line", "integer-wall", "not-json", "not-object", "no-t0_ns",
        "bool-t0_ns", "text-t0_wall", "too-long",
    ],
)  # fmt: skip
def test_the_time_zero_line(
    pipe: tuple[int, int], chunks: list[bytes], expected: TimeZero | str
) -> None:
    read, write = pipe
    for chunk in chunks:
        os.write(write, chunk)
    if isinstance(expected, TimeZero):
        assert timezero.wait(read, timeout=30) == expected
        return
    with pytest.raises(NoTimeZero) as raised:
        timezero.wait(read, timeout=30)
    assert str(raised.value) == expected


def test_no_time_zero_in_time_gives_up(pipe: tuple[int, int]) -> None:
    """A runner that never sends: the process does not wait for ever."""
    read, write = pipe
    os.write(write, b'{"t0_ns": 5')  # not a whole line
    started = time.monotonic()
    with pytest.raises(NoTimeZero) as raised:
        timezero.wait(read, timeout=0.2)
    assert str(raised.value) == "no time zero within 0.2 s"
    assert time.monotonic() - started < 10


def test_a_closed_pipe_gives_up_at_once(pipe: tuple[int, int]) -> None:
    """The runner died (its end of the pipe closed): no reason to wait out the timeout."""
    read, write = pipe
    os.close(write)
    with pytest.raises(NoTimeZero) as raised:
        timezero.wait(read, timeout=600)
    assert str(raised.value) == "stdin ended before time zero came (the runner is gone)"


def test_time_zero_after_a_delay_is_that_far_ahead_on_both_clocks() -> None:
    before_ns, before_wall = time.monotonic_ns(), time.time()
    zero = TimeZero.after(0.5)
    after_ns, after_wall = time.monotonic_ns(), time.time()
    assert before_ns + 500_000_000 <= zero.ns <= after_ns + 500_000_000
    assert before_wall + 0.5 <= zero.wall <= after_wall + 0.5
    assert TimeZero.parse(zero.line()) == zero


def test_the_wait_for_time_zero_outlasts_the_runners_waits_before_it_sends() -> None:
    """The minimal controller is started first; the runner then waits for the sniffer's and
    the workers' ready lines (READY_TIMEOUT each) before it sends time zero."""
    assert timezero.START_WAIT > 2 * runner.READY_TIMEOUT
