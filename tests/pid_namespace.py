"""TEST SUPPORT: run a command in a pid namespace of its own, as a container without hostPID runs
a job."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def unshared(*argv: str, boottime: int | None = None) -> subprocess.Popen[str]:
    """``argv`` in a pid namespace of its own (with its own /proc), or the test skipped;
    ``boottime``: also in a time namespace whose boot-time clock is that many seconds ahead."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    options = ["--pid", "--fork", "--mount-proc"]
    if boottime is not None:
        options += ["--time", f"--boottime={boottime}"]
    probe = subprocess.run(["unshare", *options, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make such namespaces here: {probe.stderr.strip()}")
    return subprocess.Popen(  # --kill-child: killing unshare ends the namespace
        ["unshare", "--kill-child", *options, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
