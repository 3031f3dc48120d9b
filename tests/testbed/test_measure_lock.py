"""The measurement lock: a run under ``flock FILE CMD`` does not wait on its own caller."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowsched.testbed.measure_lock import held_by_an_ancestor

#: prints whether the process running it descends from a holder of the lock file argv[1]
PROBE = (
    "import sys; from pathlib import Path; "
    "from flowsched.testbed.measure_lock import held_by_an_ancestor; "
    "print(held_by_an_ancestor(Path(sys.argv[1])))"
)
ROOT = Path(__file__).resolve().parents[2]


def _probe(lock: Path, *wrapper: str) -> str:
    command = [*wrapper, sys.executable, "-c", PROBE, str(lock)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("mode", ["-s", "-x"])
def test_a_lock_held_by_the_caller_is_seen_through_its_children(mode: str, tmp_path: Path) -> None:
    if shutil.which("flock") is None:
        pytest.skip("needs util-linux's flock")
    lock = tmp_path / "measure.lock"
    lock.touch()
    # flock -> sh -> python: the holder is the grandparent
    assert _probe(lock, "flock", mode, str(lock), "sh", "-c", '"$0" "$@"') == "True"
    assert _probe(lock) == "False"


def test_a_lock_held_by_another_process_is_not_the_callers(tmp_path: Path) -> None:
    if shutil.which("flock") is None:
        pytest.skip("needs util-linux's flock")
    lock = tmp_path / "measure.lock"
    lock.touch()
    holder = subprocess.Popen(["flock", "-s", str(lock), "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["flock", "-xn", str(lock), "true"]).returncode == 0:  # not yet
            assert time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.02)
        # held, but by a process that is not our ancestor: waiting for it is right
        assert _probe(lock) == "False"
        assert not held_by_an_ancestor(lock)
    finally:
        holder.kill()
        holder.wait()


def test_no_lock_file_means_not_held(tmp_path: Path) -> None:
    assert not held_by_an_ancestor(tmp_path / "absent.lock")
