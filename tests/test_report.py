"""Comparison table, JSON, plots and progress bar."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from flowsched.metrics import RequestRecord, RunMetrics, RunRecords, SpanRecord
from flowsched.report import (
    Outcome,
    PlotError,
    Progress,
    best_baseline,
    table,
    to_json,
    write_all,
)


def _outcome(policy: str, load: float, attainment: float, oracle: bool = False) -> Outcome:
    records = RunRecords(
        requests=[
            RequestRecord(f"r{i}", 0.0, 1.0, 0.5 if i < attainment * 10 else 2.0) for i in range(10)
        ],
        spans=[SpanRecord("collective", "j", 0.0, 0.001 * (1 + i)) for i in range(5)],
    )
    return Outcome.from_records(policy, load, records, oracle=oracle)


OUTCOMES = [
    _outcome("rmlq", 0.5, 0.8),
    _outcome("llf", 0.5, 0.9, oracle=True),
    _outcome("fair", 0.5, 0.4),
    _outcome("rmlq", 0.9, 0.6),
    _outcome("fair", 0.9, 0.2),
]


def test_table_lists_every_run_with_oracles_marked_and_last() -> None:
    text = table(OUTCOMES, "title")
    lines = text.splitlines()
    assert lines[0] == "title"
    assert "SLO att" in lines[1] and "iter ms" not in lines[1]  # no iteration data -> no column
    block = [line for line in lines if line.startswith("0.5 ")]
    assert [line.split()[1] for line in block] == ["rmlq", "fair", "llf"]
    assert "llf (oracle)" in block[-1] and "90.0%" in block[-1]


def test_x_ideal_is_against_the_bound_of_the_same_source() -> None:
    outcomes = [
        dataclasses.replace(_outcome("ideal", 0.5, 0.8), bound=True),
        dataclasses.replace(_outcome("ideal testbed", 0.5, 0.5), bound=True, source="testbed"),
        _outcome("rmlq sim", 0.5, 0.4),
        dataclasses.replace(_outcome("rmlq testbed", 0.5, 0.4), source="testbed"),
        dataclasses.replace(_outcome("static testbed", 0.9, 0.4), source="testbed"),
    ]
    runs = {(r["policy"], r["load"]): r for r in to_json(outcomes)["runs"]}
    assert runs["rmlq sim", 0.5]["vs_ideal"] == pytest.approx(0.5)
    assert runs["rmlq testbed", 0.5]["vs_ideal"] == pytest.approx(0.8)
    assert runs["rmlq testbed", 0.5]["source"] == "testbed"
    assert runs["rmlq sim", 0.5]["source"] == "simulator"
    assert runs["static testbed", 0.9]["vs_ideal"] is None  # no testbed bound at that load
    rows = {line.split("  ")[1].strip(): line for line in table(outcomes).splitlines()[2:]}
    assert rows["rmlq testbed"].split()[-1] == "0.80"


def test_best_baseline_ignores_oracles_and_the_candidate() -> None:
    best = best_baseline(OUTCOMES, 0.5, exclude="rmlq")
    assert best is not None and best.policy == "fair"


def test_best_baseline_is_never_the_ideal_bound() -> None:
    """The bound is the ceiling, not a competitor: it attains more than every baseline, and a
    policy's ratio to the strongest baseline must not become its ratio to the bound."""
    bound = dataclasses.replace(_outcome("ideal", 0.5, 1.0), bound=True)
    best = best_baseline([bound, *OUTCOMES], 0.5, exclude="rmlq")
    assert best is not None and best.policy == "fair"
    assert best_baseline([bound], 0.5, exclude="rmlq") is None


def test_json_is_plain_and_drops_non_finite_values() -> None:
    bad = Outcome("x", 0.1, RunMetrics(ttft_p50=float("inf")))
    data = to_json([*OUTCOMES, bad], {"scenario": "s"})
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text)["runs"][-1]["metrics"]["ttft_p50_ms"] is None
    assert data["meta"] == {"scenario": "s"}
    # the table's units: % and ms
    assert data["runs"][0]["metrics"]["slo_attainment_pct"] == 80.0
    assert data["runs"][0]["metrics"]["cct_mean_ms"] == pytest.approx(3.0)


def test_a_failed_plot_fails_the_write_and_results_json_comes_last_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """results.json was written first: a plot that failed left a results.json that looked
    complete beside missing plots (and report.md was never written)."""
    out = tmp_path / "out"
    results_there: list[bool] = []  # at each savefig
    original = Figure.savefig

    def savefig(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        results_there.append((out / "results.json").exists())
        if len(results_there) == 2:
            raise OSError(28, "No space left on device")
        original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    with pytest.raises(PlotError, match="No space left on device") as info:
        write_all(out, OUTCOMES, {"scenario": "s"})
    assert results_there == [False, False]
    document = json.loads((out / "results.json").read_text())
    assert document["meta"]["plot_error"] == "OSError: [Errno 28] No space left on device"
    written = {p.name for p in info.value.paths}
    assert written == {"attainment.png", "report.md", "results.json"}
    assert {p.name for p in out.iterdir()} == written
    assert "(attainment.png)" in (out / "report.md").read_text()


def test_write_all_writes_json_markdown_and_pngs(tmp_path: Path) -> None:
    written = write_all(tmp_path / "out", OUTCOMES, {"scenario": "s"})
    names = {p.name for p in written}
    assert {
        "results.json",
        "report.md",
        "attainment.png",
        "cdf_load0.5.png",
        "cdf_load0.9.png",
    } <= names
    assert "iteration.png" not in names
    for path in written:
        assert path.stat().st_size > 0
    assert (tmp_path / "out" / "attainment.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "(attainment.png)" in report and "iteration.png" not in report  # only drawn plots


def test_progress_bar_without_tty_writes_one_line_per_step() -> None:
    stream = io.StringIO()
    bar = Progress(4, stream=stream, width=8)
    bar.step("a")
    bar.advance("a done")
    bar.advance("b done")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[........] 0/4") and " eta ? " in lines[0]
    assert lines[-1].startswith("[####....] 2/4") and lines[-1].endswith("b done")
    assert " eta 0s " in lines[-1] or " eta " in lines[-1]


def test_progress_eta_extrapolates_the_pace_so_far(monkeypatch: pytest.MonkeyPatch) -> None:
    import flowsched.report as report

    clock = [100.0]
    monkeypatch.setattr(report.time, "monotonic", lambda: clock[0])
    bar = Progress(10, stream=io.StringIO())
    clock[0] = 130.0
    bar.advance()
    bar.advance()
    bar.advance()  # 3 units in 30 s: 7 left -> 70 s
    assert " eta 1m10s " in bar.line("x")


def test_bound_first_oracles_last_and_ratio_to_the_bound() -> None:
    bound = _outcome("ideal", 0.5, 1.0)
    bound.bound = True
    text = table([*OUTCOMES, bound])
    block = [line for line in text.splitlines() if line.startswith("0.5 ")]
    assert [line.split()[1] for line in block] == ["ideal", "rmlq", "fair", "llf"]
    assert "ideal (bound)" in block[0] and "x ideal" in text.splitlines()[0]
    assert block[1].split()[-1] == "0.80"


def test_plots_have_one_colour_per_policy_and_seed_error_bars(tmp_path: Path) -> None:
    from flowsched.metrics import merge
    from flowsched.report import colour, plot_title, plot_vs_load

    seeds = [
        RunRecords(requests=[RequestRecord("a", 0.0, 1.0, 0.5 if met else 2.0)])
        for met in (True, False)
    ]
    outcome = Outcome.from_records("rmlq", 0.5, merge(seeds), seeds=seeds)
    assert outcome.spread("slo_attainment") == (0.0, 1.0)
    assert colour("rmlq") != colour("edf") and colour("rmlq") == colour("rmlq")
    meta = {"scenario": "pd", "seeds": [1, 2]}
    assert plot_title(meta, [0.5, 0.7]) == "pd, load 0.5, 0.7, seeds 1-2 (bars: min-max)"
    assert plot_vs_load(tmp_path / "a.png", [outcome], "slo_attainment", "%", 100.0, meta)


def test_error_bars_survive_a_pooled_value_outside_the_seed_range(tmp_path: Path) -> None:
    """Identical seeds give a pooled mean a rounding error away from their min and max (the
    iteration time of a run where every seed has the same iterations): no negative bar."""
    from flowsched.metrics import merge
    from flowsched.report import plot_vs_load

    outcome = Outcome.from_records("rmlq", 0.5, merge([]), seeds=[RunRecords(), RunRecords()])
    outcome.metrics = dataclasses.replace(outcome.metrics, iteration_mean=0.8101999999999999)
    outcome.per_seed = [dataclasses.replace(outcome.metrics, iteration_mean=0.8102)] * 2
    assert outcome.spread("iteration_mean") == (0.8102, 0.8102)
    assert plot_vs_load(tmp_path / "i.png", [outcome], "iteration_mean", "ms", 1e3)


@pytest.mark.parametrize(
    ("label", "source", "bound", "policy"),
    [
        # flowsched bench serving names its rows "<policy> sim" and "<policy> testbed"
        ("rmlq sim", "", False, "rmlq"),
        ("rmlq testbed", "testbed", False, "rmlq"),
        ("static sim", "", False, "static"),
        ("static+late testbed", "testbed", False, "static+late"),
        ("ideal testbed", "testbed", True, "ideal"),
        ("edf", "", False, "edf"),
    ],
)
def test_a_row_takes_its_policys_colour_whatever_its_source(
    label: str, source: str, bound: bool, policy: str
) -> None:
    from flowsched.report import colour, line_style

    outcome = dataclasses.replace(_outcome(label, 0.5, 0.5), source=source, bound=bound)
    style = line_style(outcome)
    assert style["color"] == colour(policy)
    assert style["marker"] == ("s" if source else "o")  # testbed rows: squares
    assert style["label"] == outcome.display


def test_rows_of_different_policies_never_share_colour_and_line() -> None:
    """The serving benchmark's default rows: no two draw alike (``rmlq sim`` took edf's colour
    by its name's hash, ``static sim`` rmlq's)."""
    from flowsched.report import line_style

    rows = [
        dataclasses.replace(_outcome(name, 0.5, 0.5), source=source, bound=name == "ideal")
        for name in ("ideal", "rmlq", "static+late", "static")
        for source in ("", "testbed")
    ]
    rows += [_outcome(name, 0.5, 0.5) for name in ("edf", "edf+late", "fair")]
    rows += [_outcome(name, 0.5, 0.5, oracle=True) for name in ("llf", "llf+late")]
    looks = [tuple(sorted((k, v) for k, v in line_style(o).items() if k != "label")) for o in rows]
    assert len(set(looks)) == len(rows)
