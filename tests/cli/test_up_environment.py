"""``flowsched up`` prints the environment NCCL processes should export: every path in it
must work from any directory (the user pastes the lines into a job's shell elsewhere)."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flowsched.protocol import write_token

DONE = "# Ctrl-C stops both."


def _exports(proc: subprocess.Popen[str], timeout: float = 30.0) -> dict[str, str]:
    """The ``export`` lines ``up`` prints once both daemons are ready, as a dict."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True).start()
    exports: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line.startswith("export "):
            for word in shlex.split(line)[1:]:
                name, _, value = word.partition("=")
                exports[name] = value
        if line.strip() == DONE:
            return exports
    pytest.fail(f"flowsched up printed no environment (exit {proc.poll()})")


def test_the_exported_paths_are_absolute_and_exist(tmp_path: Path) -> None:
    write_token(tmp_path / "token")
    (tmp_path / "run").mkdir()
    env = {**os.environ, "HOME": str(tmp_path), "FLOWSCHED_NO_UVLOOP": "1"}
    args = ["up", "--token-file", "token", "--table", "run/table", "--socket",
            "run/agent.sock", "--listen", "127.0.0.1:0", "--metrics-port", "0",
            "--agent-metrics-port", "0"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowsched", *args],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        exports = _exports(proc)
        for name in ("FLOWSCHED_TABLE", "FLOWSCHED_SOCKET"):
            path = Path(exports[name])
            assert path.is_absolute(), f"{name}={path}: a job elsewhere would not find it"
            assert path.exists(), f"{name}={path}"
        assert exports["FLOWSCHED_TABLE"] == str(tmp_path / "run" / "table")
        assert exports["FLOWSCHED_SOCKET"] == str(tmp_path / "run" / "agent.sock")
        if "NCCL_NET_PLUGIN" in exports:
            assert Path(exports["NCCL_NET_PLUGIN"]).is_file()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0  # Ctrl-C is a clean stop
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
