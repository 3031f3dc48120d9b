"""``flowsched bench contention``: every bad option or scenario is refused (exit 2, a message
naming the field) before anything runs; good ones reach the benchmark validated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowsched.cli import main
from flowsched.testbed import bench, netns
from flowsched.testbed.trace import MAX_HOSTS, load_params, params_from_mapping


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[bench.BenchOptions]:
    """The options bench.run was called with (it runs nothing)."""
    calls: list[bench.BenchOptions] = []

    def run(options: bench.BenchOptions, *args: Any) -> list[Any]:
        calls.append(options)
        return []

    monkeypatch.setattr(bench, "run", run)
    return calls


def _scenario(tmp_path: Path, body: str) -> str:
    path = tmp_path / "scenario.toml"
    path.write_text(f"[testbed]\n{body}\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    ("argv", "scenario", "message"),
    [
        (["--scenario", "/nonexistent/scenario.toml"], None, "--scenario: /nonexistent"),
        ([], "param_sync_period = 0", "testbed.param_sync_period: must be > 0"),
        ([], "kv_mean_bytes = 0", "testbed.kv_mean_bytes: must be > 0"),
        ([], "tp_layers = 0", "testbed.tp_layers: must be > 0"),
        ([], "tp_compute = 0\ntp_message_bytes = 0", "testbed.tp_compute"),
        ([], "duration = inf", "testbed.duration"),
        ([], "kv_min_bytes = 7000000", "testbed.kv_min_bytes"),
        (["--duration", "0"], None, "testbed.duration: must be > 0"),
        (["--duration", "-1"], None, "testbed.duration"),
        (["--load", "0"], None, "testbed.load"),
        (["--hosts", "17"], None, "testbed.hosts"),
        (["--hosts", "18"], None, "testbed.hosts"),
        (["--hosts", "2"], None, "testbed.hosts"),
        (["--rate-mbit", "0"], None, "--rate-mbit: 0.0 is outside 1..10000"),
        (["--min-share", "0.5"], None, "--min-share: 0.5 is outside 0..0.2"),
        (["--switch-queue-kb", "0"], None, "--switch-queue-kb: expected an integer >= 1"),
        (["--seeds", "0"], None, "--seeds must be at least 1"),
        (["--policies", " , "], None, "--policies"),
        (["--policies", "nosuch"], None, "nosuch"),
        (
            ["--policies", "fair,rmlq", "--ablation-policies", "rmlq,static"],
            None,
            "--ablation-policies: static not in --policies",
        ),
    ],
    ids=[
        "missing-scenario",
        "sync-period-0",
        "kv-mean-0",
        "tp-layers-0",
        "tp-layer-no-time",
        "duration-inf",
        "kv-min-above-max",
        "duration-0",
        "duration-negative",
        "load-0",
        "hosts-17",
        "hosts-18",
        "hosts-2",
        "rate-0",
        "min-share",
        "switch-queue-0",
        "seeds-0",
        "no-policies",
        "unknown-policy",
        "ablation-not-run",
    ],
)
def test_refused_with_a_message_naming_the_field(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    ran: list[bench.BenchOptions],
    argv: list[str],
    scenario: str | None,
    message: str,
) -> None:
    if scenario is not None:
        argv = ["--scenario", _scenario(tmp_path, scenario), *argv]
    try:
        status = main(["bench", "contention", "--simulate-only", *argv])
    except SystemExit as exc:  # argparse's own refusal (a flag's type)
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert ran == []


def test_overrides_apply_on_top_of_the_scenario(
    tmp_path: Path, ran: list[bench.BenchOptions]
) -> None:
    path = _scenario(tmp_path, "hosts = 6\nduration = 9.0\nload = 0.4\nparam_sync_period = 2.0")
    argv = ["--scenario", path, "--load", "0.7", "--hosts", "8", "--ablation-policies", "rmlq"]
    assert main(["bench", "contention", *argv]) == 0
    options = ran[0]
    assert (options.params.hosts, options.params.duration, options.params.load) == (8, 9.0, 0.7)
    assert options.params.param_sync_period == 2.0 and options.spec.hosts == 8
    assert options.ablation_policies == ("rmlq",)


def test_without_scenario_the_default_file_is_used(ran: list[bench.BenchOptions]) -> None:
    assert main(["bench", "contention", "--simulate-only"]) == 0
    assert ran[0].params == load_params(bench.BENCH_DIR / "scenario.toml")


@pytest.mark.parametrize("hosts", [4, 6, MAX_HOSTS], ids=["4", "6", "max"])
def test_even_host_counts_up_to_the_topology_limit(hosts: int) -> None:
    assert params_from_mapping({"hosts": hosts}).hosts == hosts


def test_testbed_must_be_a_table(tmp_path: Path) -> None:
    path = tmp_path / "scenario.toml"
    path.write_text("testbed = 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="testbed: expected a table"):
        load_params(path)


def test_a_testbed_left_behind_is_a_failure_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A run whose teardown could not remove its namespaces ends with exit status 1 and a line
    naming them, not with a traceback nor as a removed testbed."""

    def run(options: bench.BenchOptions, *args: Any) -> list[Any]:
        raise netns.TestbedLeftBehind("could not remove netns fsE-h1 (busy) of the testbed fsE-*")

    monkeypatch.setattr(bench, "run", run)
    assert main(["bench", "contention", "--out", str(tmp_path)]) == 1
    assert "could not remove netns fsE-h1 (busy)" in capsys.readouterr().err


@pytest.mark.usefixtures("lock_dir")
@pytest.mark.parametrize("failing", ["fair", "calibration"])
def test_a_testbed_run_that_fails_to_start_is_an_error_of_its_row(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    failing: str,
) -> None:
    """A run whose daemon or worker does not start (run_policy's RuntimeError) is an error of
    that run: the other runs go on and the report is written, exit status 1 (the calibration
    run's: its figure is left out, said). It ended the whole benchmark with a traceback, every
    finished run's measurements lost."""
    from flowsched import policies
    from flowsched.testbed import replay, runner

    def run_policy(topo: object, trace: Any, cfg: Any, path: Path, work: Path, **kw: Any) -> Any:
        if (failing == "calibration") == (trace.seed == 0) and path.stem == "fair":
            raise RuntimeError("the worker of h1 did not start: exited with status 1")
        records = replay.replay(trace, policies.create("fair", num_levels=8))
        return runner.TestbedRun("fair", records)

    monkeypatch.setattr(netns, "_build", lambda topo, dscp: None)
    monkeypatch.setattr(netns, "cleanup", lambda prefix: [])
    monkeypatch.setattr(netns, "probe", lambda prefix="fsE-": None)
    monkeypatch.setattr(runner, "run_policy", run_policy)
    monkeypatch.setattr(bench, "CALIBRATION", {})
    out = tmp_path / "out"
    argv = ["--out", str(out), "--policies", "fair,static", "--sim-policies", ""]
    status = main(["bench", "contention", "--duration", "1", "--seeds", "1", *argv])
    err = capsys.readouterr().err
    assert status == (1 if failing == "fair" else 0) and "Traceback" not in err
    assert "the worker of h1 did not start: exited with status 1" in err
    doc = json.loads((out / "results.json").read_text())
    assert doc["policies"]["static"]["testbed"] is not None
    if failing == "fair":
        assert doc["policies"]["fair"]["errors"] == [
            "seed 1: the worker of h1 did not start: exited with status 1"
        ]
        assert "| fair | testbed !1 err | - |" in (out / "report.md").read_text()


@pytest.mark.usefixtures("lock_dir")
@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        ([], True),
        (["--control", "mini", "--ablation-policies", "fair"], True),  # the ablation: agent
        (["--control", "mini"], False),
        (["--simulate-only"], False),
    ],
    ids=["agent", "agent-ablation", "mini", "simulate-only"],
)
def test_a_testbed_run_without_the_plugin_is_refused_before_the_testbed_is_built(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
    refused: bool,
) -> None:
    """An install without the plugin (FLOWSCHED_SKIP_PLUGIN=1) built the testbed and started
    every run, each failing in its TP ranks; the runs that need it are refused at once."""
    from flowsched import nccl, policies
    from flowsched.testbed import replay, runner

    built: list[object] = []

    def run_policy(topo: object, trace: Any, cfg: Any, path: Path, work: Path, **kw: Any) -> Any:
        return runner.TestbedRun("fair", replay.replay(trace, policies.create("fair")))

    monkeypatch.delenv(nccl.PATH_ENV, raising=False)
    monkeypatch.setattr(nccl, "candidate_paths", lambda: [tmp_path / nccl.LIBRARY_NAME])
    monkeypatch.setattr(netns, "_build", lambda topo, dscp: built.append(topo))
    monkeypatch.setattr(netns, "cleanup", lambda prefix: [])
    monkeypatch.setattr(netns, "probe", lambda prefix="fsE-": None)
    monkeypatch.setattr(runner, "run_policy", run_policy)
    monkeypatch.setattr(bench, "CALIBRATION", {})
    argv = [*argv, "--out", str(tmp_path / "out"), "--policies", "fair", "--sim-policies", ""]
    status = main(["bench", "contention", "--duration", "1", "--seeds", "1", *argv])
    err = capsys.readouterr().err
    if refused:
        assert (status, built) == (1, [])
        assert err.startswith("flowsched bench contention: the testbed's TP ranks drive the NCCL")
        assert "build it with `make -C nccl_plugin`" in err and len(err.splitlines()) == 1
    else:
        assert status == 0 and "NCCL plugin" not in err


@pytest.mark.parametrize(
    ("argv", "policies", "sim_policies"),
    [
        (["--policies", "fair,rmlq,fair"], ("fair", "rmlq"), ("ideal",)),
        (["--policies", "fair", "--sim-policies", "ideal,llf,ideal"], ("fair",), ("ideal", "llf")),
    ],
    ids=["policies", "sim-policies"],
)
def test_a_policy_named_twice_runs_once(
    ran: list[bench.BenchOptions],
    argv: list[str],
    policies: tuple[str, ...],
    sim_policies: tuple[str, ...],
) -> None:
    """A name given twice ran twice into the same work folder, showed two rows, and kept one
    in results.json (keyed by policy): the other run's figures were lost without a word."""
    argv = ["--sim-policies", "ideal", *argv] if "--sim-policies" not in argv else argv
    assert main(["bench", "contention", "--simulate-only", *argv]) == 0
    assert (ran[0].policies, ran[0].sim_policies) == (policies, sim_policies)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--simulate-only"], "flowsched bench contention: terminated\n"),
        ([], "flowsched bench contention: terminated; the testbed was removed\n"),
    ],
    ids=["simulate-only", "testbed"],
)
def test_a_stop_speaks_of_a_testbed_only_where_one_ran(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    def stopped(options: bench.BenchOptions, *args: Any) -> list[Any]:
        raise netns.Terminated(15)

    monkeypatch.setattr(bench, "run", stopped)
    assert main(["bench", "contention", *argv]) == 143
    assert capsys.readouterr().err == said
