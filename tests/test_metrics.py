"""Run metrics from hand-made completion records."""

from __future__ import annotations

import pytest

from flowsched.metrics import (
    DeadlineRecord,
    FlowRecord,
    RequestRecord,
    RunRecords,
    SpanRecord,
    merge,
    percentile,
    summarize,
)


def _records() -> RunRecords:
    return RunRecords(
        flows=[
            FlowRecord(1, "tp", 10, 0.0, 1.0),
            FlowRecord(2, "tp", 10, 0.0, 3.0),
            FlowRecord(3, "kv", 10, 1.0, 1.5, deadline=2.0),
        ],
        requests=[
            RequestRecord("a", arrival=0.0, slo=1.0, finished=0.5),  # met, 0.5 early
            RequestRecord("b", arrival=1.0, slo=1.0, finished=3.0),  # missed by 1.0
            RequestRecord("c", arrival=2.0, slo=1.0, finished=3.0),  # exactly on time: met
            RequestRecord("d", arrival=3.0, slo=1.0, finished=None),  # never finished: miss
            RequestRecord("w", arrival=0.0, slo=1.0, finished=9.0, warmup=True),  # ignored
        ],
        spans=[
            SpanRecord("collective", "j", 0.0, 0.002),
            SpanRecord("collective", "j", 1.0, 1.004),
            SpanRecord("iteration", "t", 0.0, 1.0),
            SpanRecord("iteration", "t", 1.0, 3.0),
            SpanRecord("iteration", "t", 3.0, 30.0, warmup=True),
        ],
        deadlines=[
            DeadlineRecord("param_sync", "t", 2.0, 1.5),
            DeadlineRecord("param_sync", "t", 2.0, 2.5),
            DeadlineRecord("param_sync", "t", 2.0, None),
            DeadlineRecord("param_sync", "t", 2.0, 1.9),
        ],
    )


def test_summary_of_hand_computed_records() -> None:
    m = summarize(_records())
    assert m.requests == 4
    assert m.slo_attainment == pytest.approx(0.5)
    assert m.ttft_p50 == pytest.approx(1.0)  # ttfts 0.5, 2.0, 1.0 -> median 1.0
    assert m.ttft_mean == pytest.approx(3.5 / 3)
    assert m.earliness_mean == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert m.earliness_pos_mean == pytest.approx(0.5 / 3)
    assert m.cct_mean == pytest.approx(0.003)
    assert m.iteration_mean == pytest.approx(1.5)
    assert m.iterations == 2
    assert m.deadline_transfers == 4
    assert m.deadline_miss_rate == pytest.approx(0.5)
    assert m.class_fct["tp"] == {"count": 2.0, "p50": 2.0, "p99": pytest.approx(2.98), "mean": 2.0}
    assert m.class_fct["kv"]["mean"] == pytest.approx(0.5)


def test_deadline_earliness_is_used_without_requests() -> None:
    records = _records()
    records.requests.clear()
    m = summarize(records)
    assert m.slo_attainment is None
    assert m.earliness_mean == pytest.approx((0.5 - 0.5 + 0.1) / 3)


def test_empty_run_has_no_numbers() -> None:
    m = summarize(RunRecords())
    assert (m.slo_attainment, m.cct_mean, m.iteration_mean, m.deadline_miss_rate) == (None,) * 4
    assert m.to_dict()["flows"] == 0


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([3.0], 99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([0.0, 10.0], 90, 9.0),
    ],
    ids=["empty", "single", "median-even", "max-unsorted", "interpolated"],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == (pytest.approx(expected) if expected is not None else None)


def test_merge_pools_runs() -> None:
    pooled = merge([_records(), _records()])
    assert len(pooled.requests) == 10 and len(pooled.deadlines) == 8
    assert summarize(pooled).slo_attainment == pytest.approx(0.5)
