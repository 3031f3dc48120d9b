"""TEST SUPPORT: run a command in a pid namespace of its own, as a container without hostPID runs
a job."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def unshared(*argv: str) -> subprocess.Popen[str]:
    """``argv`` in a pid namespace of its own (with its own /proc), or the test skipped."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.strip()}")
    return subprocess.Popen(  # --kill-child: killing unshare ends the namespace
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
