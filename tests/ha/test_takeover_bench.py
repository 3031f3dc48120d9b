"""bench/takeover.py end to end at a small size: its simulated agents, sealed (protocol 5) and
unsealed (4), follow a takeover by a real standby coordinator through a real etcd (the times
themselves are the benchmark's business, not a test's)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench_script_loader import BENCH
from ha_helpers import need_etcd

from flowsched.protocol import FRAME_MAC_VERSION


def test_sealed_and_unsealed_agents_are_all_back_under_the_standby(tmp_path: Path) -> None:
    need_etcd()
    out = tmp_path / "runs.json"
    protocols = f"{FRAME_MAC_VERSION},{FRAME_MAC_VERSION - 1}"
    subprocess.run(
        [sys.executable, str(BENCH / "takeover.py"), "--agents", "12", "--flows", "5",
         "--runs", "1", "--modes", "default", "--protocols", protocols, "--json", str(out)],
        check=True, timeout=240,
    )  # fmt: skip
    runs = json.loads(out.read_text())
    assert [run["protocol"] for run in runs] == [FRAME_MAC_VERSION, FRAME_MAC_VERSION - 1]
    assert [run["sealed_agents"] for run in runs] == [12, 0]  # the new leader's sessions
    for run in runs:  # NaN: the agents were not all back within the bench's timeout
        assert math.isfinite(run["all_back_s"]) and run["all_back_s"] >= run["lead_s"] > 0, run
