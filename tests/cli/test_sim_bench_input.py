"""``flowsched sim``, ``bench contention``, ``bench serving`` and ``policy``: bad input ends with
status 2 and one line naming the flag, before any run (a bad ``--out`` too: the cases below
would run for minutes, ``sim paper`` for an hour, if it were checked only at the end); a
shipped policy file can be named from any directory.

Each case runs the real ``flowsched`` command in a subprocess, from an unrelated directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: a file where a directory is expected (``{file}``), a policy file with an error (``{bad}``),
#: a file that is not UTF-8 text (``{binary}``), one that is not TOML (``{nottoml}``)
CASES = {
    "sim-loads-not-a-number": (["sim", "pd-serving", "--loads", "abc"], "--loads"),
    "sim-loads-zero": (["sim", "pd-serving", "--loads", "0.5,0"], "--loads"),
    "sim-loads-nan": (["sim", "pd-serving", "--loads", "nan"], "--loads"),
    "sim-loads-inf": (["sim", "pd-serving", "--loads", "inf"], "--loads"),
    "sim-loads-none": (["sim", "pd-serving", "--loads", ","], "--loads"),
    # absurd finite loads: an OverflowError (RL transfer sizes) or a run that never ended
    "sim-loads-huge": (["sim", "rl-disaggregated", "--loads", "1e300"],
                       "--loads: expected finite numbers >= 0.001 and < 100, got 1e+300"),
    "sim-loads-tiny": (["sim", "pd-serving", "--loads", "0.5,1e-300"],
                       "--loads: expected finite numbers >= 0.001 and < 100, got 1e-300"),
    "sim-unknown-policy": (["sim", "pd-serving", "--policies", "nosuch"], "--policies"),
    "sim-rmlq-late": (["sim", "pd-serving", "--policies", "rmlq+late"],
        "--policies: 'rmlq+late': rmlq has no late-dropping variant"),
    "contention-sim-rmlq-late": (
        ["bench", "contention", "--simulate-only", "--sim-policies", "rmlq+late"],
        "--sim-policies: 'rmlq+late': rmlq has no late-dropping variant"),
    "serving-karuna-late": (
        ["bench", "serving", "--simulate-only", "--policies", "rmlq,karuna+late"],
        "--policies: 'karuna+late': karuna has no late-dropping variant"),
    "sim-bad-policy-file": (["sim", "pd-serving", "--policy-file", "{bad}"], "--policy-file"),
    "sim-missing-policy-file": (
        ["sim", "pd-serving", "--policy-file", "{dir}/nope.toml"], "--policy-file"),
    "sim-seeds-zero": (["sim", "pd-serving", "--seeds", "0"], "--seeds"),
    # random.Random(-n) is random.Random(n): seeds -1..1 pooled seed 1's trace twice
    "sim-seed-negative": (["sim", "pd-serving", "--seed", "-1", "--seeds", "3"],
        "--seed: expected at least 0, got -1"),
    "contention-seed-negative": (["bench", "contention", "--simulate-only", "--seed", "-1"],
        "--seed must be at least 0"),
    "serving-seed-negative": (["bench", "serving", "--simulate-only", "--seed", "-1"],
        "--seed: expected at least 0, got -1"),
    "sim-no-policies": (["sim", "pd-serving", "--policies", ","], "--policies"),
    "sim-scenario-is-a-directory": (["sim", "{dir}"], "cannot read"),
    "sim-scenario-not-utf8": (["sim", "{binary}"], "cannot read"),
    "sim-out-is-a-file": (["sim", "paper", "--out", "{file}"], "--out"),
    "sim-out-under-a-file": (["sim", "paper", "--out", "{file}/sub"], "--out"),
    "contention-out-is-a-file": (
        ["bench", "contention", "--simulate-only", "--out", "{file}"], "--out"),
    "contention-load-too-high": (["bench", "contention", "--load", "2"], "testbed.load"),
    "contention-rate-negative": (
        ["bench", "contention", "--rate-mbit", "-5"], "--rate-mbit: -5.0 is outside 1..10000"),
    "contention-rate-nan": (["bench", "contention", "--rate-mbit", "nan"], "--rate-mbit"),
    "contention-min-share-too-high": (
        ["bench", "contention", "--min-share", "0.5"], "--min-share: 0.5 is outside 0..0.2"),
    "contention-switch-queue-negative": (
        ["bench", "contention", "--switch-queue-kb", "-1"], "--switch-queue-kb: expected an "
        "integer >= 1, got '-1'"),
    "contention-scenario-not-toml": (
        ["bench", "contention", "--scenario", "{nottoml}"], "{nottoml}: invalid TOML"),
    "contention-scenario-not-utf8": (
        ["bench", "contention", "--scenario", "{binary}"], "{binary}: cannot read"),
    "contention-scenario-is-a-directory": (
        ["bench", "contention", "--scenario", "{dir}"], "--scenario: {dir}: not a file"),
    "serving-loads-zero": (["bench", "serving", "--loads", "0"], "--loads"),
    "serving-loads-too-high": (["bench", "serving", "--loads", "0.6,5"], "--loads"),
    "serving-loads-nan": (["bench", "serving", "--loads", "nan"], "--loads"),
    "serving-loads-tiny": (["bench", "serving", "--loads", "1e-300"],
                           "--loads: expected finite numbers >= 0.001 and < 2, got 1e-300"),
    "serving-loads-not-a-number": (["bench", "serving", "--loads", "x"], "--loads"),
    "serving-seeds-zero": (["bench", "serving", "--seeds", "0"], "--seeds"),
    "serving-unknown-policy": (
        ["bench", "serving", "--simulate-only", "--policies", "rmlq,nosuch"],
        "--policies: unknown policy 'nosuch'"),
    "serving-unknown-sim-policy": (
        ["bench", "serving", "--simulate-only", "--sim-policies", "nosuch"],
        "--sim-policies: unknown policy 'nosuch'"),
    "serving-out-is-a-file": (
        ["bench", "serving", "--simulate-only", "--loads", "0.5,0.6,0.7", "--seeds", "3",
         "--out", "{file}"], "--out"),
}  # fmt: skip


def _flowsched(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(cwd), "FLOWSCHED_NO_UVLOOP": "1"}
    return subprocess.run(
        [sys.executable, "-m", "flowsched", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
    )  # fmt: skip


@pytest.mark.parametrize(("args", "message"), list(CASES.values()), ids=list(CASES))
def test_bad_input_exits_2_with_one_line_before_any_run(
    args: list[str], message: str, tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("")
    (tmp_path / "bad.toml").write_text("[policy]\nname = 'rmlq'\n[classes.kv]\ndeadline = -1\n")
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe[scenario]\n")
    fill = {"{file}": str(tmp_path / "afile"), "{bad}": str(tmp_path / "bad.toml")}
    fill["{binary}"] = str(tmp_path / "binary.toml")
    (tmp_path / "nottoml.toml").write_text("[testbed\n")
    fill["{nottoml}"] = str(tmp_path / "nottoml.toml")
    fill["{dir}"] = str(tmp_path)
    argv = []
    for arg in args:
        for key, value in fill.items():
            arg = arg.replace(key, value)
        argv.append(arg)
    proc = _flowsched(argv, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for key, value in fill.items():
        message = message.replace(key, value)
    assert message in proc.stderr
    assert proc.stdout == ""  # nothing ran


@pytest.mark.parametrize(
    "failure",
    [OSError(28, "No space left on device"), ValueError("a broken bundled scenario")],
    ids=["oserror", "valueerror"],
)
def test_a_serving_run_that_fails_exits_1_not_2(
    failure: Exception,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Any OSError or ValueError of the run itself (not of the command line) exited 2, the
    status of bad input."""
    from flowsched.cli import main
    from flowsched.testbed import serving

    def run(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(serving, "run", run)
    argv = ["bench", "serving", "--simulate-only", "--out", str(tmp_path / "out")]
    assert main(argv) == 1
    assert capsys.readouterr().err == f"flowsched bench serving: {failure}\n"


@pytest.mark.parametrize("command", ["sim", "contention", "serving"])
def test_a_plot_that_failed_fails_the_command(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Drawing a plot failed after the results were written: exit 1, one line saying so."""
    from flowsched.cli import main
    from flowsched.cli import sim as sim_cli
    from flowsched.report import PlotError
    from flowsched.testbed import bench, serving

    failure = PlotError("drawing the plots failed (OSError: disk full)", [])

    def fails(*args: object, **kwargs: object) -> None:
        raise failure

    out = str(tmp_path / "out")
    if command == "sim":
        monkeypatch.setattr(sim_cli, "write_all", fails)
        path = tmp_path / "rl.toml"
        path.write_text(
            '[scenario]\nname = "rl"\n[rl]\ntrainer_nodes = 2\nrollout_nodes = 2\n'
            "iterations = 3\nwarmup_iterations = 1\nsteps_per_iteration = 1\n"
            "phases_per_step = 1\ngeneration_chunks = 1\n"
        )
        argv = ["sim", str(path), "--policies", "fair", "--loads", "0.5", "--quiet"]
    else:
        monkeypatch.setattr(bench if command == "contention" else serving, "run", fails)
        argv = ["bench", command, "--simulate-only"]
    assert main([*argv, "--out", out]) == 1
    name = "flowsched sim" if command == "sim" else f"flowsched bench {command}"
    assert capsys.readouterr().err.splitlines()[-1] == f"{name}: {failure}"


def test_help_states_the_accepted_ranges_and_suffixes(tmp_path: Path) -> None:
    contention = _flowsched(["bench", "contention", "--help"], tmp_path).stdout
    assert "0 < LOAD < 2" in " ".join(contention.split())
    assert "NAME+late" in contention and "NAME-late" not in contention
    serving = " ".join(_flowsched(["bench", "serving", "--help"], tmp_path).stdout.split())
    assert "0 < LOAD < 2" in serving


def test_policy_list_prints_paths_that_work_from_anywhere(tmp_path: Path) -> None:
    listing = _flowsched(["policy", "list"], tmp_path)
    assert listing.returncode == 0, listing.stderr
    files = [line.split(None, 1)[1] for line in listing.stdout.splitlines() if line[:4] == "file"]
    assert any(f.endswith("/pd-serving.toml") for f in files)
    for file in files:
        assert Path(file).is_absolute() and Path(file).is_file(), file
    check = _flowsched(["policy", "check", *files], tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("name", ["pd-serving", "pd-serving.toml"])
def test_policy_check_and_show_take_a_shipped_name(tmp_path: Path, name: str) -> None:
    check = _flowsched(["policy", "check", name], tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{name}: ok" in check.stdout
    show = _flowsched(["policy", "show", name], tmp_path)
    assert show.returncode == 0, show.stdout + show.stderr
    assert "pd-serving.toml" in show.stdout.splitlines()[0]


def test_a_local_file_wins_over_a_shipped_name(tmp_path: Path) -> None:
    (tmp_path / "pd-serving").write_text("not toml [")
    check = _flowsched(["policy", "check", "pd-serving"], tmp_path)
    assert check.returncode == 2
    assert "invalid TOML" in check.stdout
