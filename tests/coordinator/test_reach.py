"""A standby's count of the agents that cannot reach the leader, and when it deposes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowsched.coordinator.reach import (
    Knocks,
    Reach,
    decode_reach,
    encode_reach,
    should_depose,
    sustained_for,
)


def _knocks(times: dict[str, list[float]]) -> Knocks:
    knocks = Knocks(sustained_after=5.0, gap=10.0)
    for at, node in sorted((t, node) for node, ts in times.items() for t in ts):
        knocks.note(node, at)
    return knocks


@pytest.mark.parametrize(
    ("times", "now", "cut_off"),
    [
        pytest.param({"a": [0.0]}, 0.0, [], id="one-knock"),
        pytest.param({"a": [0.0, 3.0, 6.0]}, 6.0, ["a"], id="kept-knocking"),
        pytest.param({"a": [0.0, 3.0]}, 4.9, [], id="not-long-enough"),
        pytest.param({"a": [0.0]}, 9.0, [], id="one-knock-is-no-streak"),
        pytest.param({"a": [0.0, 4.0]}, 9.0, [], id="knocks-span-too-little"),
        pytest.param({"a": [0.0, 3.0]}, 13.1, [], id="stopped-knocking"),
        pytest.param({"a": [0.0, 11.0, 14.0]}, 14.0, [], id="gap-restarts-the-streak"),
        pytest.param({"a": [0.0, 11.0, 16.0]}, 16.0, ["a"], id="new-streak-sustained"),
        pytest.param({"b": [0.0, 6.0], "a": [1.0, 6.0], "c": [5.0]}, 6.0, ["a", "b"], id="sorted"),
    ],
)
def test_cut_off_nodes(times: dict[str, list[float]], now: float, cut_off: list[str]) -> None:
    assert _knocks(times).cut_off(now) == cut_off


def test_tracked_nodes_are_bounded_and_ended_streaks_make_room() -> None:
    knocks = Knocks(sustained_after=1.0, gap=10.0, limit=2)
    knocks.note("a", 0.0)
    knocks.note("b", 0.0)
    knocks.note("c", 1.0)  # over the limit: not counted
    knocks.note("a", 1.0)
    knocks.note("b", 1.0)
    knocks.note("c", 2.0)
    assert knocks.cut_off(2.0) == ["a", "b"]
    knocks.note("a", 5.0)  # a known node's streak goes on
    knocks.note("c", 11.5)  # b's streak ended (last 1.0): room for c
    knocks.note("c", 12.5)
    assert knocks.cut_off(12.5) == ["a", "c"]


def test_clear_forgets_every_streak() -> None:
    knocks = _knocks({"a": [0.0, 6.0]})
    knocks.clear()
    assert knocks.cut_off(6.0) == []


@pytest.mark.parametrize(
    ("cut_off", "serves", "turned_away", "depose"),
    [
        (1, 0, 0, True),
        (3, 2, 0, True),
        (2, 2, 0, False),
        (2, 3, 0, False),
        (0, 0, 0, False),
        # a leader that turns agents away at its caps is reached by them: never deposed
        (3, 1, 2, False),
        (3, 0, 1, False),
    ],
)
def test_only_strictly_more_cut_off_agents_depose_a_leader_that_turns_none_away(
    cut_off: int, serves: int, turned_away: int, depose: bool
) -> None:
    assert should_depose(cut_off, Reach(7, serves, turned_away)) is depose


@given(st.integers(1, 2**62), st.integers(0, 2**31), st.integers(0, 2**20))
def test_reach_round_trips(epoch: int, agents: int, turned_away: int) -> None:
    reach = Reach(epoch, agents, turned_away)
    assert decode_reach(encode_reach(reach)) == reach


def test_a_reach_without_turned_away_counts_none() -> None:
    assert decode_reach('{"epoch": 3, "agents": 2}') == Reach(3, 2, 0)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        "not json",
        '{"epoch": 1}',
        '{"epoch": 0, "agents": 1}',
        '{"epoch": 1, "agents": -1}',
        '{"epoch": true, "agents": 1}',
        '{"epoch": 1, "agents": 1.5}',
        '{"epoch": 1, "agents": 1, "turned_away": -1}',
        '{"epoch": 1, "agents": 1, "turned_away": "x"}',
    ],
)
def test_what_is_not_a_reach_reads_as_none(text: str) -> None:
    assert decode_reach(text) is None


@pytest.mark.parametrize(("ttl", "sustained"), [(2, 5.0), (10, 5.0), (11, 5.25), (30, 10.0)])
def test_knocks_count_once_the_leaders_published_count_has_caught_up(
    ttl: int, sustained: float
) -> None:
    # the count is published at each keepalive (TTL/4) and follows a lost session within 2.5 s
    assert sustained_for(ttl / 4) == sustained
