"""bench/sdk_flood.py runs its two phases against a real coordinator and agent (the timings
are the benchmark's business; that another user's opens are answered during the flood is
checked here too, as the in-process test in test_agent_sdk_limits.py checks it)."""

from __future__ import annotations

import os

import pytest
from bench_script_loader import load_bench_script

from flowsched.testbed.sdk_flood import shareable_group


@pytest.mark.skipif(os.geteuid() != 0, reason="the flood comes from another uid: needs root")
def test_the_flood_benchmark_measures_both_phases_and_the_agent_keeps_its_session() -> None:
    if shareable_group() is None:
        pytest.skip("no group among users/nogroup/daemon/staff to give the flooding user")
    idle, flooded = load_bench_script("sdk_flood.py").measure(seconds=1.0, interval=0.25)
    for phase in (idle, flooded):
        assert len(phase.times) == 4
        assert None not in phase.times, phase.summary()  # every open answered within 2 s
        assert (phase.switches, phase.connects) == (0, 1), phase.summary()
    assert idle.flood_opens == 0
    assert flooded.flood_opens > 0  # the flood was served meanwhile, not shut out
