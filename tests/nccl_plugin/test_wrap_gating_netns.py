"""The permit on the netns testbed (one htb class, no switch priority): bench/gating_bench.py.

A high-level and a low-level connection through the wrapper (and through our TCP transport
with gating on) on one device. Checked here, as behaviour: with the permit the high flow keeps
far more of the link next to the low bulk flow than without it, the low flow keeps a share of
its own (the guard) instead of half the link, and the cross dependency ends with the guard and
not without. The throughput goals themselves (>= 0.9x alone through the wrapper, >= 0.85x on
the TCP transport) are the benchmark's: it prints them, and a loaded machine moves them, so
they are not asserted in the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_gating_goals_on_the_testbed(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs iproute2 (ip, tc)")
    out = tmp_path / "gating.json"
    # --no-lock: like the other netns tests, the suite runs under the measurement lock when
    # it must (flock /tmp/flowsched-measure.lock pytest ...); taking it again here would wait
    # on our own caller
    args = ["--seconds", "4", "--low-start", "1.5", "--out", str(out), "--no-lock"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gating_bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout)
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip())
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    configs = report["configs"]
    ungated = configs["wrap-ungated"]
    # without the permit the link is shared about evenly
    assert ungated["low_share"] > 0.3, report
    for name in ("wrap-gated", "tcp-gated"):
        gated = configs[name]
        # the permit gives the link to the high flow: far above the shared case...
        assert gated["high_ratio"] > ungated["high_ratio"] + 0.15, (name, report)
        # ...while the low flow keeps a share of its own (the guard), not half the link
        assert 0.025 <= gated["low_share"] < 0.25, (name, report)
    assert report["cross_dependency"]["guards"]["completed"], report
    assert not report["cross_dependency"]["no_guard"]["completed"], report
    # 0: every goal met; 1: a throughput goal missed on a loaded machine (printed above)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
