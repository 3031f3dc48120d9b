"""hwqueues.compress: hand-computed tables and the monotone/in-range properties."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowsched.policies import hwqueues


@pytest.mark.parametrize(
    ("rule", "num_levels", "hw_queues", "expected"),
    [
        ("ends", 8, 4, (0, 1, 1, 1, 2, 2, 2, 3)),
        ("ends", 8, 2, (0, 1, 1, 1, 1, 1, 1, 1)),
        ("ends", 8, 3, (0, 1, 1, 1, 1, 1, 1, 2)),
        ("ends", 12, 8, (0, 1, 1, 2, 2, 3, 4, 4, 5, 5, 6, 7)),
        ("top", 8, 4, (0, 1, 1, 1, 2, 2, 3, 3)),
        ("proportional", 8, 4, (0, 0, 1, 1, 2, 2, 3, 3)),
        ("ends", 4, 8, (0, 1, 2, 3)),
        ("proportional", 8, 1, (0,) * 8),
    ],
    ids=["ends-8-4", "ends-8-2", "ends-8-3", "ends-12-8", "top-8-4", "prop-8-4", "identity", "one"],
)
def test_compress_table(
    rule: str, num_levels: int, hw_queues: int, expected: tuple[int, ...]
) -> None:
    assert hwqueues.table(num_levels, hw_queues, rule) == expected


@given(
    rule=st.sampled_from(hwqueues.RULES),
    num_levels=st.integers(1, 64),
    hw_queues=st.integers(1, 8),
)
def test_compress_is_monotone_in_range_and_keeps_ends(
    rule: str, num_levels: int, hw_queues: int
) -> None:
    queues = hwqueues.table(num_levels, hw_queues, rule)
    assert all(0 <= q < hw_queues for q in queues)
    assert all(a <= b for a, b in itertools.pairwise(queues))
    assert queues[0] == 0
    if num_levels >= hw_queues:
        assert queues[-1] == hw_queues - 1  # every queue's range ends at the last queue
    if rule in ("ends", "top") and hw_queues >= 2 and num_levels > 1:
        assert queues.count(0) == 1  # level 0 alone in the top queue
    if rule == "ends" and 3 <= hw_queues <= num_levels:
        assert queues.count(hw_queues - 1) == 1  # scavenger alone in the last queue


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((8, 8, 4), "outside"),
        ((-1, 8, 4), "outside"),
        ((0, 8, 0), "hw_queues"),
        ((1, 8, 4, "x"), "unknown"),
    ],
    ids=["level-too-high", "negative", "no-queues", "bad-rule"],
)
def test_compress_rejects_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hwqueues.compress(*args)
