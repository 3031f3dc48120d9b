"""The contention report: which plots it draws and links, and its one percentile rule."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from flowsched import policies
from flowsched.metrics import FlowRecord, RunMetrics, RunRecords
from flowsched.report import PlotError
from flowsched.testbed import replay, report
from flowsched.testbed.trace import ScenarioParams, generate

META = {
    "command": "flowsched bench contention",
    "mode": "test",
    "setup": "none.",
    "seed": 1,
    "seeds": [1],
    "duration": 1.0,
    "load": 0.5,
    "flows": 0,
    "rate_mbit": 200.0,
}


def _results(testbed: bool) -> list[report.PolicyResult]:
    """fair and static on one short trace; the testbed rows are the replay again."""
    trace = generate(ScenarioParams(duration=1.0, load=0.5), 25e6, 1)
    results = []
    for name in ("fair", "static"):
        records = replay.replay(trace, policies.create(name, num_levels=8))
        result = report.PolicyResult(name, None, RunMetrics())
        result.seeds.append(report.SeedRun(1, records, records if testbed else None))
        result.pool()
        results.append(result)
    return results


@pytest.fixture
def legends(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """File name -> legend labels of every figure saved while the test runs."""
    saved: dict[str, list[str]] = {}
    original = Figure.savefig

    def savefig(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        legend = self.axes[0].get_legend() if self.axes else None
        saved[Path(fname).name] = [t.get_text() for t in legend.get_texts()] if legend else []
        original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


@pytest.mark.parametrize(
    ("testbed", "plots", "bars"),
    [
        (False, {"slo_attainment.png", "cdf_sim.png"}, ["simulator"]),
        (
            True,
            {"slo_attainment.png", "cdf_testbed.png", "cdf_sim.png"},
            ["testbed", "simulator"],
        ),
    ],
    ids=["simulator-only", "testbed"],
)
def test_report_links_and_draws_only_what_exists(
    tmp_path: Path,
    legends: dict[str, list[str]],
    testbed: bool,
    plots: set[str],
    bars: list[str],
) -> None:
    paths = report.write(_results(testbed), META, tmp_path)
    written = {p.name for p in paths if p.suffix == ".png"}
    assert written == plots == {p.name for p in tmp_path.glob("*.png")}
    linked = re.findall(r"!\[[^]]*\]\(([^)]+)\)", (tmp_path / "report.md").read_text())
    assert sorted(linked) == sorted(plots)
    assert legends["slo_attainment.png"] == bars


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([3.0, 1.0, 2.0], 0.5, 2.0),
        ([4.0, 1.0, 3.0, 2.0], 0.5, 3.0),
        ([float(v) for v in range(1, 11)], 0.9, 10.0),
        ([float(v) for v in range(1, 21)], 0.9, 19.0),
        ([5.0], 0.9, 5.0),
        ([1.0, 2.0], 1.0, 2.0),
    ],
    ids=["odd-median", "even-median-upper", "p90-of-10", "p90-of-20", "one", "q1"],
)
def test_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert report.nearest_rank(values, q) == expected


def test_nearest_rank_needs_values() -> None:
    with pytest.raises(ValueError, match="no values"):
        report.nearest_rank([], 0.5)


def test_summaries_use_nearest_rank() -> None:
    """The admission quantiles and the promotion p90 (the promotion median stays the mean of
    the two middle values)."""
    result = report.PolicyResult("fair", None, RunMetrics(), admission=[0.4, 0.1, 0.3, 0.2])
    result.promotions = [0.4, 0.1, 0.3, 0.2]
    assert report._quantiles(result.admission) == {"p50": 0.3, "p90": 0.4, "count": 4.0}
    summary = report.promotion_summary([result])
    assert (summary["median"], summary["p90"]) == (pytest.approx(0.25), 0.4)


def test_drops_line_counts_the_policies_that_ran_on_the_testbed() -> None:
    """Each testbed policy's drops and their sum; a simulator-only row is left out."""
    fair = report.PolicyResult("fair", None, RunMetrics(), testbed_records=RunRecords())
    static = report.PolicyResult(
        "static", None, RunMetrics(), testbed_records=RunRecords(), dropped_packets=12
    )
    sim_only = report.PolicyResult("edf+late", None, RunMetrics(), dropped_packets=0)
    line = report.drops_line([fair, static, sim_only])
    assert line == "the testbed's ports dropped 12 packets (fair 0, static 12)"


def _records(*flows: tuple[str, int]) -> RunRecords:
    """Records of flows given as (class, first level)."""
    return RunRecords(
        flows=[FlowRecord(i, cls, 1, 0.0, 1.0, first_level=lv) for i, (cls, lv) in enumerate(flows)]
    )


@pytest.mark.parametrize(
    ("flows", "tp_level", "top", "above"),
    [
        # rmlq's layout: an urgent tier of levels 0-1 above the collectives on 2
        ([("kv", 0), ("kv", 1), ("kv", 1), ("kv", 6), ("tp", 2), ("tp", 3)], None, 0.25, 0.75),
        # static: the collectives on top, every KV flow below them
        ([("kv", 1), ("kv", 1), ("tp", 0)], None, 0.0, 0.0),
        # fair: one level for all, so no KV flow is above a collective
        ([("kv", 0), ("kv", 0), ("tp", 0)], None, 1.0, 0.0),
        # edf: the collectives last
        ([("kv", 0), ("kv", 4), ("tp", 7)], None, 0.5, 1.0),
        # testbed records hold no TP flow: the level comes from the simulator's run
        ([("kv", 0), ("kv", 1), ("kv", 5)], 2, 1 / 3, 2 / 3),
        ([("kv", 0), ("kv", 1)], None, 0.5, None),  # no TP level at all
        ([("kv", -1), ("tp", 2)], None, 0.0, 0.0),  # a flow never given a level is not above
        ([("tp", 2)], None, None, None),  # no KV flow
    ],
)
def test_kv_flows_at_the_top_and_above_the_collectives(
    flows: list[tuple[str, int]], tp_level: int | None, top: float | None, above: float | None
) -> None:
    records = _records(*flows)
    assert report.top_share(records) == top
    assert report.above_collectives_share(records, tp_level) == above


def _seeded(name: str, attainments: list[float | None]) -> report.PolicyResult:
    """``name`` with one run per seed 1, 2, ... of the testbed attainments given (None: that
    seed's testbed run did not start)."""
    result = report.PolicyResult(name, None, RunMetrics())
    for seed, value in enumerate(attainments, start=1):
        run = report.SeedRun(seed, RunRecords(), None if value is None else RunRecords())
        run.testbed_attainment = value
        result.seeds.append(run)
    return result


@pytest.mark.parametrize(
    ("fair", "expected"),
    [
        ([0.5, 0.4, 0.3], "rmlq / fair = 1.20, 1.50, 2.00; rmlq / static = 2.00, 2.00, 2.00."),
        ([0.5, None, 0.3], "rmlq / fair = 1.20, -, 2.00; rmlq / static = 2.00, 2.00, 2.00."),
        ([0.5, 0.0, 0.3], "rmlq / fair = 1.20, -, 2.00; rmlq / static = 2.00, 2.00, 2.00."),
    ],
    ids=["every-seed", "a-run-missing", "fair-attained-none"],
)
def test_seed_by_seed_ratios_keep_each_seeds_place(fair: list[float | None], expected: str) -> None:
    """The ratios are listed in the order of the seeds, unlabelled: one left out (a testbed run
    that did not start, a zero to divide by) moved the next seed's ratio into its place."""
    results = [
        _seeded("rmlq", [0.6, 0.6, 0.6]),
        _seeded("fair", fair),
        _seeded("static", [0.3, 0.3, 0.3]),
    ]
    lines = [line for line in report.headline(results) if "seed by seed" in line]
    assert lines == [f"  - testbed, seed by seed: {expected}"]


def test_a_testbed_policy_with_errors_is_marked_in_the_headline_plot_and_seed_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table marks a testbed row whose runs recorded errors; the lines under it (rmlq vs
    edf, fair and static: 'both'), the per-seed table and the plot showed the same figures as
    those of complete runs."""
    trace = generate(ScenarioParams(duration=1.0, load=0.5), 25e6, 1)
    results = []
    for name in ("fair", "static", "edf", "rmlq"):
        records = replay.replay(trace, policies.create(name, num_levels=8))
        result = report.PolicyResult(name, None, RunMetrics())
        for seed in (1, 2):
            result.seeds.append(report.SeedRun(seed, records, records))
        result.pool()
        results.append(result)
    results[3].errors = ["seed 2: worker h0 exited with status -9 (its log: worker-h0.log)"]
    lines = report.headline(results)
    assert "  - testbed: measured in runs that recorded errors: rmlq !1 err." in lines
    assert not any("errors" in line for line in lines if not line.startswith("  - testbed"))
    _, rows = report.seed_rows(results)
    assert [r[1] for r in rows if r[0] == "rmlq"] == ["testbed !1 err", "sim"]
    assert [r[1] for r in rows if r[0] == "fair"] == ["testbed", "sim"]
    ticks: dict[str, list[str]] = {}
    original = Figure.savefig

    def savefig(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        ticks[Path(fname).name] = [t.get_text() for t in self.axes[0].get_xticklabels()]
        original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    report.plot(results, tmp_path, 0.5, {"seeds": [1, 2]})
    assert ticks["slo_attainment.png"] == ["fair", "static", "edf", "rmlq !1 err"]


def test_a_failed_plot_fails_the_write_after_the_report_and_results_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """results.json was written before the plots: a plot that failed left it looking complete
    (no report.md at all)."""
    results_there: list[bool] = []

    def savefig(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        results_there.append((tmp_path / "results.json").exists())
        raise RuntimeError("no renderer")

    monkeypatch.setattr(Figure, "savefig", savefig)
    with pytest.raises(PlotError, match="no renderer"):
        report.write(_results(False), META, tmp_path)
    assert results_there == [False]
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["meta"]["plot_error"] == "RuntimeError: no renderer"
    assert (tmp_path / "report.md").exists() and not list(tmp_path.glob("*.png"))
