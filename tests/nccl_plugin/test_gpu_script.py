"""bench/gpu/allreduce_check.py cannot run without a GPU; check what can be checked here:
it compiles, and its dry run gives each rank the environment the reference recipe asks for."""

from __future__ import annotations

import py_compile
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "allreduce_check.py"


def test_script_compiles() -> None:
    py_compile.compile(str(SCRIPT), doraise=True)


def test_dry_run_environment(plugin_lib: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    rows = {
        (line.split()[0], line.split()[1]): dict(kv.split("=", 1) for kv in line.split()[2:])
        for line in out
    }
    assert set(rows) == {("flowsched", "0"), ("flowsched", "1"), ("Socket", "0"), ("Socket", "1")}
    for (transport, rank), env in rows.items():
        assert env["NCCL_NET"] == transport and env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["NCCL_HOSTID"] == f"flowsched-node{rank}"
        assert env["CUDA_VISIBLE_DEVICES"] == "0"
    plugin = Path(rows[("flowsched", "0")]["NCCL_NET_PLUGIN"])
    assert plugin.is_absolute() and plugin.name == "libnccl-net-flowsched.so" and plugin.is_file()
    assert rows[("Socket", "0")]["NCCL_NET_PLUGIN"] == "none"
