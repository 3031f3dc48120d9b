"""What stops or degrades a testbed run, without namespaces (fake builds and probes):

* a run whose testbed runs recorded errors says so on stderr, marks its rows and exits 1;
* a second run with the same prefix is refused while the first holds the testbed, and the first
  run's testbed is left alone; a dead holder's lock file does not block;
* a program the build runs (sysctl) missing, or a build that fails, means the simulator only.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowsched import policies
from flowsched.cli import main
from flowsched.metrics import RunRecords
from flowsched.testbed import bench, netns, replay, report
from flowsched.testbed.trace import ScenarioParams, Trace

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from flowsched.testbed import netns
    netns.LOCK_DIR = Path(sys.argv[1])
    lock = netns.benchmark_lock() if sys.argv[2] == "benchmark" else netns.prefix_lock(sys.argv[2])
    with lock:
        print("locked", flush=True)
        time.sleep(60)
    """
)


@pytest.fixture
def fake_testbed(monkeypatch: pytest.MonkeyPatch, lock_dir: Path) -> list[str]:
    """Probe and build succeed without building anything; the cleanups are recorded."""
    cleanups: list[str] = []

    def cleanup(prefix: str) -> list[str]:
        cleanups.append(prefix)
        return []

    monkeypatch.setattr(netns, "probe", lambda prefix="fsE-": None)
    monkeypatch.setattr(netns, "_build", lambda topo, dscp: None)
    monkeypatch.setattr(netns, "cleanup", cleanup)
    return cleanups


def _simulated_run(errors: int) -> object:
    """bench._testbed_run replaced by a replay that records ``errors`` errors."""

    def run(
        topo: netns.Topology,
        trace: Trace,
        result: report.PolicyResult,
        work: Path,
        options: object,
    ) -> RunRecords:
        result.errors += [f"seed {trace.seed}: TP job tp0: broken {i}" for i in range(errors)]
        return replay.replay(trace, policies.create("fair", num_levels=8))

    return run


def _contention(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "bench", "contention", "--out", str(tmp_path / "out"), "--policies", "fair",
        "--sim-policies", "", "--seeds", "1", "--duration", "1", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("errors", [1, 7])
def test_recorded_errors_are_listed_marked_and_exit_1(
    monkeypatch: pytest.MonkeyPatch,
    fake_testbed: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    errors: int,
) -> None:
    monkeypatch.setattr(bench, "_testbed_run", _simulated_run(errors))
    monkeypatch.setattr(bench, "calibrate", lambda *args, **kwargs: {})
    assert main(_contention(tmp_path)) == 1
    out, err = capsys.readouterr()
    assert f"testbed {report.ERROR_MARK}{errors} err" in out  # the row is marked
    assert f"{errors} errors were recorded" in err
    assert "TP job tp0: broken 0" in err
    shown = min(errors, bench.SHOWN_ERRORS)
    assert err.count("TP job tp0: broken") == shown
    if errors > shown:
        assert f"and {errors - shown} more" in err
    assert (tmp_path / "out" / "results.json").exists()  # the report is still written


def test_a_clean_testbed_run_exits_0_unmarked(
    monkeypatch: pytest.MonkeyPatch,
    fake_testbed: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(bench, "_testbed_run", _simulated_run(0))
    monkeypatch.setattr(bench, "calibrate", lambda *args, **kwargs: {})
    assert main(_contention(tmp_path)) == 0
    out, err = capsys.readouterr()
    assert report.ERROR_MARK not in out
    assert "error" not in err


def test_ablation_errors_mark_the_ablation_row_only() -> None:
    result = report.PolicyResult("rmlq", None, report.RunMetrics())
    result.errors = ["seed 1: x", "seed 1, ablation (mini control): y", "seed 2, ablation (a): z"]
    assert report.error_counts(result) == (1, 2)


def test_the_table_is_printed_before_the_files_are_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def write(*args: object) -> list[Path]:
        raise OSError("disk full")

    monkeypatch.setattr(report, "write", write)
    stream = io.StringIO()
    options = bench.BenchOptions(
        out=tmp_path / "out",
        policies=("fair",),
        params=ScenarioParams(duration=1.0),
        seed=1,
        spec=netns.TopologySpec(prefix="fsU-"),
        simulate_only=True,
    )
    with pytest.raises(OSError, match="disk full"):
        bench.run(options, stream=stream)
    assert "SLO att." in stream.getvalue()


def _hold(lock_dir: Path, prefix: str) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(lock_dir), prefix], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_is_refused_while_the_first_holds_the_testbed(
    fake_testbed: list[str], lock_dir: Path
) -> None:
    holder = _hold(lock_dir, "fsU-")
    try:
        with (
            pytest.raises(netns.TestbedBusy, match=f"pid {holder.pid}.*fsU-"),
            netns.testbed(netns.TopologySpec(prefix="fsU-")),
        ):
            pytest.fail("the testbed was built")
        assert fake_testbed == []  # the first run's namespaces were not "cleaned up"
        with netns.testbed(netns.TopologySpec(prefix="fsU2-")):  # another prefix: free
            pass
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # the holder died (SIGKILL: no chance to remove its lock file): the kernel released the lock
    assert (lock_dir / "fsU-.lock").exists()
    with netns.testbed(netns.TopologySpec(prefix="fsU-")):
        pass
    assert fake_testbed == ["fsU2-", "fsU2-", "fsU-", "fsU-"]


def test_the_processes_a_run_starts_do_not_keep_its_lock(lock_dir: Path) -> None:
    with netns.prefix_lock("fsU-"):
        child = subprocess.Popen(["sleep", "30"])
    try:
        with netns.prefix_lock("fsU-"):  # the child still runs: the lock is free anyway
            assert child.poll() is None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)


def test_the_benchmark_stops_when_the_testbed_is_busy(
    fake_testbed: list[str], lock_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = _hold(lock_dir, "fsE-")  # the benchmark's prefix
    try:
        assert main(_contention(tmp_path)) == 1
    finally:
        holder.kill()
        holder.wait(timeout=10)
    err = capsys.readouterr().err
    assert "another run" in err and f"pid {holder.pid}" in err
    assert "simulator only" not in err  # no silent fallback
    assert fake_testbed == []


@pytest.mark.parametrize("command", ["contention", "serving"])
def test_a_testbed_benchmark_is_refused_while_another_one_runs(
    monkeypatch: pytest.MonkeyPatch,
    fake_testbed: list[str],
    lock_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """bench contention (fsE-) and bench serving (fsv) took only their own prefix's lock, so
    they ran side by side, each one's timings measuring the other's load."""
    from flowsched.testbed import serving

    monkeypatch.setattr(bench, "_testbed_run", _simulated_run(0))
    monkeypatch.setattr(bench, "calibrate", lambda *args, **kwargs: {})
    monkeypatch.setattr(serving, "run_live", lambda *a, **k: serving.LiveRun(RunRecords()))
    argv = _contention(tmp_path)
    if command == "serving":
        argv = ["bench", "serving", "--out", str(tmp_path / "out"), "--policies", "rmlq"]
    holder = _hold(lock_dir, "benchmark")  # another benchmark, another prefix
    try:
        assert main(argv) == 1
    finally:
        holder.kill()
        holder.wait(timeout=10)
    err = capsys.readouterr().err
    assert err.startswith(
        f"flowsched bench {command}: another run (pid {holder.pid}) is running a testbed "
        "benchmark on this machine (two spoil each other's timings)"
    )
    assert "simulator only" not in err  # no silent fallback
    assert fake_testbed == []  # nothing built


def test_probe_names_a_missing_program(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without sysctl (no procps, as in minimal images) the build would fail half-way."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("ip", "tc"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    reason = netns.probe("fsU-")
    assert reason is not None and "sysctl (procps)" in reason


def test_a_build_that_fails_is_testbed_unavailable(
    monkeypatch: pytest.MonkeyPatch, fake_testbed: list[str]
) -> None:
    def build(topo: netns.Topology, dscp: object) -> None:
        raise RuntimeError('ip netns exec fsU-sw sysctl failed (1): exec of "sysctl" failed')

    monkeypatch.setattr(netns, "_build", build)
    with (
        pytest.raises(netns.TestbedUnavailable, match=r"cannot build the testbed: .*sysctl"),
        netns.testbed(netns.TopologySpec(prefix="fsU-")),
    ):
        pytest.fail("yielded a testbed that was not built")
    assert fake_testbed == ["fsU-", "fsU-"]  # what the build made is removed


def test_a_failed_build_falls_back_to_the_simulator(
    monkeypatch: pytest.MonkeyPatch,
    fake_testbed: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def build(topo: netns.Topology, dscp: object) -> None:
        raise RuntimeError("sysctl: not found")

    monkeypatch.setattr(netns, "_build", build)
    assert main(_contention(tmp_path)) == 0
    out, err = capsys.readouterr()
    assert "testbed unavailable: cannot build the testbed: sysctl: not found" in err
    assert "running the simulator only" in err
    assert " sim " in out and "testbed" not in out.split("wrote")[0]
