"""The testbed's minimal controller: admission, re-evaluation and level messages."""

from __future__ import annotations

import json
import socket
import time

import pytest

from flowsched import policies
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
