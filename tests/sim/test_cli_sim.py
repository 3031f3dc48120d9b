"""End to end: ``flowsched sim`` on a tiny scenario writes the table, JSON and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import flowsched.cli.sim as sim_cli
from flowsched.cli import main
from flowsched.sim.run import late_variants, variant

TINY = """
[scenario]
name = "tiny"
seed = 3
[serving]
layers = 4
requests = 24
warmup_requests = 4
[rl]
trainer_nodes = 2
rollout_nodes = 2
iterations = 3
warmup_iterations = 1
steps_per_iteration = 2
phases_per_step = 2
generation_ms = 100.0
generation_chunks = 4
"""


@pytest.mark.slow
def test_sim_writes_table_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    out = tmp_path / "out"
    status = main(
        ["sim", str(path), "--policies", "fair,static,llf", "--loads", "0.4,0.8", "--out", str(out)]
    )
    assert status == 0
    captured = capsys.readouterr()
    assert "tiny (mixed), seed 3" in captured.out
    assert "llf (oracle)" in captured.out
    assert "6/6" in captured.err  # progress bar
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 6
    assert {r["policy"] for r in data["runs"]} == {"fair", "static", "llf"}
    assert all(r["metrics"]["requests"] == 24 for r in data["runs"])
    for name in ("attainment.png", "iteration.png", "cdf_load0.4.png", "report.md"):
        assert (out / name).stat().st_size > 0


def test_sim_rejects_a_bad_scenario_with_the_field_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(TINY.replace("layers = 4", "layers = -4"))
    assert main(["sim", str(path), "--policies", "fair", "--loads", "0.5"]) == 2
    assert "serving.layers" in capsys.readouterr().err


def test_sim_rejects_an_unknown_policy(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    with pytest.raises(SystemExit, match="unknown policy 'nope'"):
        main(["sim", str(path), "--policies", "fair,nope", "--loads", "0.5"])


@pytest.mark.parametrize(
    ("names", "refusal"),
    [
        ("rmlq+late", "'rmlq+late': rmlq has no late-dropping variant: it prunes late requests"),
        ("fair,karuna+late", "'karuna+late': karuna has no late-dropping variant (NAME+late is"),
        ("sjf+late", "'sjf+late': sjf has no late-dropping variant (NAME+late is for the "
         "policies that take drop_late: static, edf, llf)"),
        ("static+late,edf+late,llf+late,rmlq", None),
    ],
)  # fmt: skip
def test_only_the_policies_that_take_drop_late_have_a_late_variant(
    names: str, refusal: str | None
) -> None:
    """``rmlq+late`` was refused with rmlq's whole argument list (``policy.args.drop_late:
    unknown key (known: E, U, ...)``), as if a key were misspelt."""
    if refusal is None:
        built = sim_cli.specs(names.split(","), None, 8)
        assert [s.title for s in built] == names.split(",")
        assert [bool(s.args.get("drop_late")) for s in built] == [True, True, True, False]
        return
    with pytest.raises(SystemExit) as refused:
        sim_cli.specs(names.split(","), None, 8)
    assert str(refused.value).startswith(f"flowsched sim: --policies: {refusal}")
    assert late_variants() == ["static", "edf", "llf"]


@pytest.mark.parametrize(
    ("name", "file_policy", "expected"),
    [
        ("edf", "edf", ("edf", {"x": 1})),
        ("edf+late", "edf", ("edf", {"x": 1, "drop_late": True})),
        ("llf+late", "static", ("llf", {"drop_late": True})),
        ("llf", "static", ("llf", {})),
        ("static+late", None, ("static", {"drop_late": True})),
    ],
)
def test_a_variant_keeps_the_files_arguments_only_for_the_files_policy(
    name: str, file_policy: str | None, expected: tuple[str, dict[str, object]]
) -> None:
    file_args = {"x": 1}
    assert variant(name, file_policy, file_args) == expected
    assert file_args == {"x": 1}


def test_sim_pools_several_seeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    out = tmp_path / "out"
    args = ["sim", str(path), "--policies", "fair", "--loads", "0.5", "--seeds", "2", "--quiet"]
    assert main([*args, "--out", str(out)]) == 0
    assert "seeds 3..4 pooled" in capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["seeds"] == [3, 4]
    assert data["runs"][0]["metrics"]["requests"] == 48


def test_sim_rejects_too_few_levels_for_the_policy_before_running(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY + "[sim]\nnum_levels = 4\n")
    with pytest.raises(SystemExit, match="rmlq with K=4"):
        main(["sim", str(path), "--policies", "fair,rmlq", "--loads", "0.5"])


def test_interrupted_sim_reports_the_finished_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during the third run: the two finished policy/load pairs are still written."""

    real_run, calls = sim_cli.run, [0]

    def run_then_interrupt(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real_run(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_cli, "run", run_then_interrupt)
    path = tmp_path / "tiny.toml"
    path.write_text(TINY.replace("requests = 24", "requests = 6"))
    out = tmp_path / "out"
    status = main(
        ["sim", str(path), "--policies", "ideal,fair,static", "--loads", "0.4", "--out", str(out)]
    )
    assert status == 130
    captured = capsys.readouterr()
    assert "interrupted" in captured.err and " eta " in captured.err
    assert "ideal (bound)" in captured.out and "fair" in captured.out
    data = json.loads((out / "results.json").read_text())
    assert [r["policy"] for r in data["runs"]] == ["ideal", "fair"]
    assert data["meta"]["complete"] is False


def test_paper_is_the_pd_serving_paper_comparison() -> None:
    import argparse

    from flowsched import scenario
    from flowsched.cli.sim import PAPER, _defaults

    args = argparse.Namespace(scenario="paper", policies=None, loads=None, seeds=None)
    _defaults(args)
    assert args.scenario == "pd-serving-paper" and args.seeds == 3
    assert args.loads == "0.5,0.6,0.7"
    names = args.policies.split(",")
    assert names[0] == "ideal" and {"static+late", "edf+late", "llf+late"} <= set(names)
    scen = scenario.load(PAPER["scenario"])
    assert scen.serving is not None and scen.serving.requests >= 1000
    explicit = argparse.Namespace(scenario="paper", policies="fair", loads="0.5", seeds=1)
    _defaults(explicit)
    assert (explicit.policies, explicit.loads, explicit.seeds) == ("fair", "0.5", 1)
