"""RepeatLog (flowsched.lograte): once at once, then at a falling rate, within a bounded
number of keys."""

from __future__ import annotations

import logging

import pytest

from flowsched.lograte import RepeatLog


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("times", "logged"),
    [
        ([0.0], [0.0]),
        ([0.0, 0.5, 0.9], [0.0]),  # within the first second: once
        ([0.0, 0.5, 1.0, 1.5, 2.9, 3.0], [0.0, 1.0, 3.0]),  # then after 1 s, 2 s, ...
        ([0.0] + [0.1 * i for i in range(1, 100)], [0.0, 1.0, 3.0, 7.0]),
    ],
)
def test_repeat_log_falls_in_rate(
    times: list[float], logged: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    repeat = RepeatLog(logging.getLogger("test.repeat"), clock=clock)
    caplog.set_level(logging.INFO, logger="test.repeat")
    seen = []
    for when in times:
        clock.now = when
        if repeat.log("key", logging.WARNING, "refused at %.1f", when):
            seen.append(when)
    assert [pytest.approx(t) for t in logged] == seen
    if len(seen) > 1:
        assert "more since the last message" in caplog.records[-1].getMessage()


def test_repeat_log_starts_afresh_after_clear() -> None:
    clock = FakeClock()
    repeat = RepeatLog(logging.getLogger("test.repeat"), clock=clock)
    assert repeat.log("a:1", logging.INFO, "x")
    assert not repeat.log("a:1", logging.INFO, "x")
    repeat.clear_matching("a:")
    assert repeat.log("a:1", logging.INFO, "x")


def test_repeat_log_keeps_a_bounded_number_of_keys_forgetting_the_least_recently_logged() -> None:
    """Keys may carry what a peer chose (each address a rogue coordinator redirects to):
    without a bound, every new one stayed in the agent's memory for good."""
    clock = FakeClock()
    repeat = RepeatLog(logging.getLogger("test.repeat"), clock=clock, max_keys=3)
    for key in ("a", "b", "c"):
        assert repeat.log(key, logging.INFO, "x")
    clock.now = 1.0
    assert repeat.log("a", logging.INFO, "x")  # its interval passed: logged, now the newest
    for i in range(100):
        assert repeat.log(f"peer-{i}", logging.INFO, "x")  # new keys: each logged once
        assert len(repeat._keys) <= 3
    assert repeat.log("b", logging.INFO, "x")  # forgotten long ago: a first occurrence again
    assert not repeat.log("peer-99", logging.INFO, "x")  # kept: still spaced out


def test_a_key_logged_recently_outlives_one_logged_long_ago() -> None:
    clock = FakeClock()
    repeat = RepeatLog(logging.getLogger("test.repeat"), clock=clock, max_keys=2)
    assert repeat.log("old", logging.INFO, "x")
    assert repeat.log("busy", logging.INFO, "x")
    clock.now = 1.0
    assert repeat.log("old", logging.INFO, "x")  # "old" logged again: "busy" is now the oldest
    assert repeat.log("new", logging.INFO, "x")
    assert not repeat.log("old", logging.INFO, "x")  # kept (within its interval)
    assert repeat.log("busy", logging.INFO, "x")  # forgotten: logged as a first occurrence
