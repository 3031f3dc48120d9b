"""bench/agent_load.py's SDK open part runs against a real agent and a bare server (the
timings themselves are the benchmark's business, not a test's)."""

from __future__ import annotations

import pytest
from bench_script_loader import load_bench_script


def test_the_sdk_open_round_trip_reaches_a_real_agent_and_the_bare_server(
    fresh_sdk_connections: None,
) -> None:
    bench = load_bench_script("agent_load.py")
    ours, bare, level = bench.sdk_open_round_trip(20)
    assert level == 6  # the embedded rmlq's admission level for a kv flow with 1 s left
    for median, p99 in (ours, bare):
        assert 0 < median <= p99


@pytest.mark.parametrize(
    "seconds,expected", [([3.0, 1.0, 2.0], (2.0, 3.0)), ([0.5] * 200 + [9.0] * 2, (0.5, 0.5))]
)
def test_quantiles(seconds: list[float], expected: tuple[float, float]) -> None:
    assert load_bench_script("agent_load.py")._quantiles(seconds) == expected


def test_the_namespace_placement_part_places_a_job_namespace_with_and_without_ptrace() -> None:
    placed = load_bench_script("agent_load.py").namespace_placement(5, rounds=1)
    if placed is None:
        pytest.skip("no unshare --pid here")
    with_links, by_start = placed
    if by_start is None:
        pytest.skip("no setpriv here to run the second part with the DaemonSet's credentials")
    for scan, check, base in (with_links, by_start):  # each asserts that it placed the owner
        assert scan > 0 and check > 0 and base > 0
