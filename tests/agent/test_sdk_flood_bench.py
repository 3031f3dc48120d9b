"""bench/sdk_flood.py runs its two phases against a real coordinator and agent (the timings
are the benchmark's business; that another user's opens are answered during the flood is
checked here too, as the in-process test in test_agent_sdk_limits.py checks it)."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
from pathlib import Path

import pytest
from bench_script_loader import load_bench_script

from flowsched.testbed.sdk_flood import FLOOD_CONNECTIONS, NOBODY, flooding, shareable_group


@pytest.mark.skipif(os.geteuid() != 0, reason="the flood comes from another uid: needs root")
def test_the_flood_benchmark_measures_both_phases_and_the_agent_keeps_its_session() -> None:
    if shareable_group() is None:
        pytest.skip("no group among users/nogroup/daemon/staff to give the flooding user")
    idle, flooded = load_bench_script("sdk_flood.py").measure(seconds=1.0, interval=0.25)
    for phase in (idle, flooded):
        assert len(phase.times) == 4
        assert None not in phase.times, phase.summary()  # every open answered within 2 s
        assert (phase.switches, phase.connects) == (0, 1), phase.summary()
    assert idle.flood_opens == 0
    assert flooded.flood_opens > 0  # the flood was served meanwhile, not shut out


@pytest.mark.skipif(os.geteuid() != 0, reason="the flood switches to another uid: needs root")
def test_the_flood_is_started_without_forking_a_process_with_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The benchmark and the in-process flood test start the flood from a process with threads
    (an agent's, the daemons' log readers): os.fork() there copied into the child the locks
    those threads held, which nobody would release, and Python 3.12 on warns of it (a
    DeprecationWarning). Its child comes from multiprocessing's fork server now."""
    group = shareable_group()
    if group is None:
        pytest.skip("no group among users/nogroup/daemon/staff to give the flooding user")
    forks: list[int] = []
    fork = os.fork

    def counted_fork() -> int:
        forks.append(threading.active_count())
        return fork()

    monkeypatch.setattr(os, "fork", counted_fork)
    folder = Path(tempfile.mkdtemp(prefix="flowsched-flood-test-", dir="/tmp"))
    done = threading.Event()
    other = threading.Thread(target=done.wait, args=(30,))  # this process has threads
    other.start()
    try:
        folder.chmod(0o755)  # nobody must reach the socket
        path = str(folder / "sdk.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            os.chmod(path, 0o777)
            listener.listen(FLOOD_CONNECTIONS)
            listener.settimeout(10)
            with flooding(path, group.gr_gid):
                sock, _ = listener.accept()
                with sock:
                    credentials = sock.getsockopt(
                        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
                    )
        assert struct.unpack("3i", credentials)[1] == NOBODY  # the flood came, as nobody
    finally:
        done.set()
        other.join()
        shutil.rmtree(folder, ignore_errors=True)
    assert forks == [], f"os.fork() called with {forks} threads alive"
