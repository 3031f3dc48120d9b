"""The testbed's minimal controller: admission, re-evaluation and level messages."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from flowsched import policies
from flowsched.testbed import bench, timezero
from flowsched.testbed.daemons import reap
from flowsched.testbed.minictl import Controller, LinkMeter


def _levels(conn: socket.socket) -> list[dict[str, object]]:
    conn.settimeout(0.5)
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return [json.loads(line) for line in data.splitlines()]


@pytest.mark.parametrize(
    ("cls", "expected"), [("tp", 0), ("kv", 1), ("bulk", 7)], ids=["tp", "kv", "bulk"]
)
def test_static_admission_sends_the_class_level(cls: str, expected: int) -> None:
    ctl = Controller(policies.create("static", num_levels=8), time.monotonic_ns(), 25e6, 0.01)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        before = time.monotonic_ns()
        ctl.handle({"t": "open", "id": 7, "cls": cls, "size": 1000}, ours)
        (msg,) = _levels(theirs)
    assert msg["t"] == "level" and msg["id"] == 7 and msg["level"] == expected
    assert isinstance(msg["ns"], int) and msg["ns"] >= before


def test_rmlq_promotes_an_experience_flow_as_its_consumer_approaches() -> None:
    ctl = Controller(policies.create("rmlq", num_levels=8), time.monotonic_ns(), 25e6, 0.01)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ctl.handle({"t": "job", "job": "j", "step": 0}, ours)
        ctl.handle(
            {
                "t": "open",
                "id": 1,
                "cls": "experience",
                "size": 10_000_000,
                "job": "j",
                "consumer_step": 3,
            },
            ours,
        )
        first = _levels(theirs)[-1]["level"]
        ctl.handle({"t": "job", "job": "j", "step": 3}, ours)
        later = _levels(theirs)
        ctl.handle({"t": "close", "id": 1}, ours)
    assert later and later[-1]["level"] < first
    assert ctl.flows == {}


def test_bad_message_fields_raise_for_the_connection_handler() -> None:
    ctl = Controller(policies.create("fair", num_levels=1), time.monotonic_ns(), 25e6, 0.01)
    ours, theirs = socket.socketpair()
    with ours, theirs, pytest.raises(ValueError):
        ctl.handle({"t": "open", "id": 1, "cls": "nonsense"}, ours)


def test_link_meter_without_ports_reports_nothing() -> None:
    meter = LinkMeter({}, 25e6)
    meter.sample()
    assert meter.load == {}


@contextlib.contextmanager
def _minictl() -> Iterator[tuple[subprocess.Popen[bytes], tuple[str, int]]]:
    """The controller as the runner starts it (stdin, stdout and stderr on pipes) and its
    address; killed and reaped after the block."""
    argv = ["--policy", str(bench.policy_path("static")), "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowsched.testbed.minictl", *argv, "--bandwidth", "25e6"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("minictl listening on 127.0.0.1:"), line
        yield proc, ("127.0.0.1", int(line.rsplit(":", 1)[1]))
    finally:
        reap(proc)


def test_a_worker_that_connects_before_time_zero_is_served_after_it() -> None:
    """Workers connect while they set up, before the runner sends time zero; the controller
    serves them from time zero on (so every open is handled with time zero known)."""
    with _minictl() as (proc, address), socket.create_connection(address, timeout=30) as conn:
        assert proc.stdin is not None
        conn.sendall(json.dumps({"t": "open", "id": 7, "cls": "kv", "size": 1000}).encode())
        conn.sendall(b"\n")
        proc.stdin.write(timezero.TimeZero.after(0.0).line())
        proc.stdin.flush()
        with conn.makefile("rb") as reader:
            level = json.loads(reader.readline())
    assert (level["t"], level["id"], level["level"]) == ("level", 7, 1)


def test_the_controller_gives_up_when_time_zero_never_comes() -> None:
    """The runner is gone (its end of the pipe closed): the controller exits, saying why."""
    with _minictl() as (proc, _):
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 1
        stderr = proc.stderr.read().decode()
    assert stderr == "minictl: stdin ended before time zero came (the runner is gone)\n"
