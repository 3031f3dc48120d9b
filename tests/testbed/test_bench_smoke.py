"""A short end-to-end run of ``flowsched bench contention`` on the real testbed (< 60 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.usefixtures("netns_ok")]


def test_bench_contention_smoke(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowsched",
            "bench",
            "contention",
            "--out",
            str(out),
            "--duration",
            "2",
            "--load",
            "0.5",
            "--policies",
            "fair,rmlq",
            "--ablation-policies",
            "rmlq",
            "--seeds",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SLO att." in proc.stdout
    for name in (
        "results.json",
        "report.md",
        "slo_attainment.png",
        "cdf_testbed.png",
        "cdf_sim.png",
    ):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["mode"] == "testbed + simulator replay"
    # the share of CPU time the hypervisor took during the testbed runs (0 on bare metal)
    assert 0.0 <= data["meta"]["steal"] < 1.0
    assert "the hypervisor stole " in proc.stdout
    # the main rows ran on the real coordinator, agents, SDK and the NCCL plugin for TP
    assert data["meta"]["control"] == "agent"
    for policy in ("fair", "rmlq"):
        entry = data["policies"][policy]
        assert entry["testbed_control"] == "agent"
        tb = entry["testbed"]
        assert tb["requests"] > 0 and tb["slo_attainment_pct"] is not None
        assert tb["cct_mean_ms"] is not None
        assert [run["seed"] for run in entry["per_seed"]] == [1, 2]
        assert all(run["testbed_slo_attainment_pct"] is not None for run in entry["per_seed"])
    # the shaped ports' drops, per policy in results.json and summed on the printed line
    drops = {p: data["policies"][p]["dropped_packets"] for p in ("fair", "rmlq")}
    assert all(isinstance(n, int) and n >= 0 for n in drops.values())
    assert (
        f"the testbed's ports dropped {sum(drops.values())} packets"
        f" (fair {drops['fair']}, rmlq {drops['rmlq']})" in proc.stdout
    )
    assert "The testbed's ports dropped " in (out / "report.md").read_text()
    # rmlq also ran with the minimal controller, labelled as an ablation
    ablation = data["policies"]["rmlq"]
    assert ablation["ablation_control"] == "mini"
    assert ablation["ablation"] is not None and ablation["ablation"]["requests"] > 0
    assert "testbed, mini ctl (ablation)" in proc.stdout


def test_simulate_only_needs_no_root(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowsched",
            "bench",
            "contention",
            "--out",
            str(out),
            "--duration",
            "2",
            "--seeds",
            "1",
            "--simulate-only",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["mode"] == "simulator only"
    # the default comparison: the bound, late-dropping baselines and the oracle, simulated
    policies = data["policies"]
    assert {"ideal", "static+late", "edf+late", "llf", "llf+late"} <= set(policies)
    assert policies["ideal"]["bound"] and policies["llf+late"]["oracle"]
    assert policies["rmlq"]["sim_kv_top_pct"] is not None
    assert "ideal (bound)" in proc.stdout and "KV@top %" in proc.stdout
    assert "rmlq" in proc.stdout and "vs edf" in proc.stdout
    # nothing ran on the testbed: no drop count claims otherwise
    assert "dropped" not in proc.stdout and "dropped" not in (out / "report.md").read_text()
