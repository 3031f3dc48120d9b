"""Wrapping mode and the host-side permit, driven as NCCL drives the plugin.

* the recording fake inner plugin: every call and argument forwarded, properties passed
  through, inner tables v12/v10/v8, failing init/connect as NCCL error codes, the permit's
  deferral, promotion, age bound and share guard, a close with a send in flight, and the
  logger of every inner init (nccl_plugin/tests/test_wrap_fake.c);
* the cross-node dependency of rdma-wrapping.md §5 (a high send that completes only once the
  receiver got a low message the permit defers): it ends with the starvation guard, through
  the wrapper and on our TCP transport, and it really deadlocks without the guard.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "nccl_plugin" / "build"
FAKES = ("libnccl-net-fake.so", "libnccl-net-fake10.so", "libnccl-net-fake8.so")


@pytest.fixture(scope="module")
def wrap_build() -> Path:
    """The plugin, the standalone fstcp inner, the fake inners and the two drivers."""
    targets = [f"build/{name}" for name in FAKES]
    targets += ["build/libnccl-net-flowsched.so", "build/libnccl-net-fstcp.so"]
    targets += ["build/test_wrap_fake", "build/gate_peer"]
    subprocess.run(
        ["make", "-s", "-C", str(ROOT / "nccl_plugin"), *targets],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return BUILD


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWSCHED_", "FSTCP_"))}
    env["FLOWSCHED_TABLE"] = "/nonexistent/flowsched-table"
    env.update(extra)
    return env


def test_fake_inner_sees_every_call(wrap_build: Path) -> None:
    fakes = [str(wrap_build / name) for name in FAKES]
    proc = subprocess.run(
        [str(wrap_build / "test_wrap_fake"), str(wrap_build / "libnccl-net-flowsched.so"), *fakes],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in (
        "ok forwarding (exported v12",
        "ok inner v10",
        "ok inner v8",
        "share guard",
        "a close with a send in flight gives the permit back",
        "every inner init gets NCCL's logger and profiler callback",
    ):
        assert line in proc.stdout
    # the inner's companion tables are not hidden silently
    assert "also exports ncclTunerPlugin_v3, which NCCL does not see through flowsched" in (
        proc.stderr
    )


MODES = {
    "wrapper": {"FLOWSCHED_NET_INNER": str(BUILD / "libnccl-net-fstcp.so")},
    "tcp": {"FLOWSCHED_GATING": "1"},
}
GUARDS = {
    "both guards": ({}, True),
    "age bound only": ({"FLOWSCHED_GATE_MIN_SHARE": "0"}, True),
    "no guard": ({"FLOWSCHED_GATE_MIN_SHARE": "0", "FLOWSCHED_GATE_MAX_DEFER_US": "0"}, False),
}


def _deadlock(
    wrap_build: Path, env: dict[str, str], ends: bool
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """gate_peer's cross-dependency run (given 10 s when it should end, 1 s when it should
    not) and its JSON verdict line."""
    timeout = 10.0 if ends else 1.0
    peer, plugin = wrap_build / "gate_peer", wrap_build / "libnccl-net-flowsched.so"
    proc = subprocess.run(
        [str(peer), str(plugin), "deadlock", str(timeout)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 30,
    )
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("guard", list(GUARDS))
def test_cross_dependency(wrap_build: Path, mode: str, guard: str) -> None:
    extra, ends = GUARDS[guard]
    env = _clean_env(FSTCP_SOCKET_IFNAME="lo", FLOWSCHED_SOCKET_IFNAME="lo", **MODES[mode], **extra)
    proc, result = _deadlock(wrap_build, env, ends)
    assert result["completed"] is ends, (result, proc.stderr)
    assert proc.returncode == (0 if ends else 3)
    if guard != "both guards":
        # the low send was really deferred (the share guard alone lets it through at once)
        assert result["low_deferred_calls"] > 0, result


POLICY = (ROOT / "flowsched" / "data" / "policies" / "default.toml").read_text()


@pytest.mark.parametrize(
    ("gating", "ends"),
    [("enabled = false", True), ("enabled = true", False), ("min_share = 0.0", False)],
    ids=["policy off", "policy on", "policy tuned"],
)
def test_policy_gating_reaches_the_plugin(
    wrap_build: Path, tmp_path: Path, gating: str, ends: bool
) -> None:
    """The agent writes the policy's [gating] into the table; the wrapper (on by default)
    follows it: off, the dependency never waits; on (or tuned), it deadlocks without guards."""
    from flowsched import policyfile
    from flowsched.agent.policy_view import PolicyView
    from flowsched.shm.table import FlowTable

    cfg = policyfile.loads(POLICY + f"\n[gating]\n{gating}\nmax_deferral = 0.0\n")
    path = tmp_path / "run" / "flowsched-table"
    table, _ = FlowTable.create_or_attach(str(path), num_slots=64)
    try:
        table.write_config(PolicyView(cfg).table_config())
        env = _clean_env(
            FLOWSCHED_NET_INNER=str(wrap_build / "libnccl-net-fstcp.so"),
            FLOWSCHED_TABLE=str(path),
            FSTCP_SOCKET_IFNAME="lo",
            FLOWSCHED_GATE_MIN_SHARE="0",
        )
        proc, result = _deadlock(wrap_build, env, ends)
    finally:
        table.close()
    assert result["completed"] is ends, (result, proc.stderr)
    if ends:
        assert result["low_deferred_calls"] == 0, result


def test_policy_gating_fields() -> None:
    from flowsched import policyfile
    from flowsched.agent.policy_view import gate_fields
    from flowsched.shm import layout

    plain = policyfile.loads(POLICY)
    assert gate_fields(plain.gating)["gate_mode"] == layout.GATE_MODE_DEFAULT
    tuned = policyfile.loads(POLICY + "\n[gating]\nmin_share = 0.1\nwindow = 0.2\n")
    assert gate_fields(tuned.gating) == {
        "gate_mode": layout.GATE_MODE_TUNED,
        "gate_min_share": 100,
        "gate_window_ms": 200,
        "gate_max_defer_ms": layout.GATE_UNSET,
    }
    with pytest.raises(policyfile.PolicyFileError, match=r"gating\.min_share"):
        policyfile.loads(POLICY + "\n[gating]\nmin_share = 2\n")
    with pytest.raises(policyfile.PolicyFileError, match=r"gating\.enabled"):
        policyfile.loads(POLICY + "\n[gating]\nenabled = 1\n")
