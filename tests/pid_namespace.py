"""TEST SUPPORT: run a command in a pid namespace of its own, as a container without hostPID runs
a job."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def unshared(
    *argv: str, boottime: int | None = None, monotonic: int | None = None
) -> subprocess.Popen[str]:
    """``argv`` in a pid namespace of its own (with its own /proc), or the test skipped;
    ``boottime``, ``monotonic``: also in a time namespace whose boot-time (monotonic) clock is
    that many seconds ahead (behind, when negative)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    options = ["--pid", "--fork", "--mount-proc"]
    if boottime is not None or monotonic is not None:
        options.append("--time")
    if boottime is not None:
        options.append(f"--boottime={boottime}")
    if monotonic is not None:
        options.append(f"--monotonic={monotonic}")
    probe = subprocess.run(["unshare", *options, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make such namespaces here: {probe.stderr.strip()}")
    return subprocess.Popen(  # --kill-child: killing unshare ends the namespace
        ["unshare", "--kill-child", *options, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
