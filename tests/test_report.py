"""Comparison table, JSON, plots and progress bar."""

from __future__ import annotations

import io
import json
from pathlib import Path

from flowsched.metrics import RequestRecord, RunMetrics, RunRecords, SpanRecord
from flowsched.report import Outcome, Progress, best_baseline, table, to_json, write_all


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


def test_best_baseline_ignores_oracles_and_the_candidate() -> None:
    best = best_baseline(OUTCOMES, 0.5, exclude="rmlq")
    assert best is not None and best.policy == "fair"


def test_json_is_plain_and_drops_non_finite_values() -> None:
    bad = Outcome("x", 0.1, RunMetrics(ttft_p50=float("inf")))
    data = to_json([*OUTCOMES, bad], {"scenario": "s"})
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text)["runs"][-1]["metrics"]["ttft_p50"] is None
    assert data["meta"] == {"scenario": "s"}
    assert data["runs"][0]["metrics"]["slo_attainment"] == 0.8


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
    assert lines[0].startswith("[........] 0/4")
    assert lines[-1].startswith("[####....] 2/4") and lines[-1].endswith("b done")
