"""bench/coordinator_load.py's wording of a latency comparison (the measurements themselves are
the benchmark's business)."""

from __future__ import annotations

import pytest
from bench_script_loader import load_bench_script


@pytest.mark.parametrize(
    "ours,theirs,text",
    [(0.68, 0.92, "1.4x lower"), (0.83, 0.69, "1.2x higher"), (1.0, 1.0, "1.0x lower")],
)
def test_a_p99_is_called_lower_only_when_it_is(ours: float, theirs: float, text: str) -> None:
    assert load_bench_script("coordinator_load.py")._lower(ours, theirs) == text
