"""bench/plugin_bench.py's arguments and its goal verdicts (the timings themselves are the
benchmark's business, not a test's)."""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

import pytest
from bench_script_loader import load_bench_script


def load() -> ModuleType:
    return load_bench_script("plugin_bench.py")


def report(quiet: float, hog: float, rtt: float = 1.2) -> dict[str, Any]:
    def part(ratio: float) -> dict[str, Any]:
        ratios = {f"throughput_{label}": ratio for label in ("1MiB", "4MiB", "64MiB")}
        return {"ratios": {**ratios, "rtt_8B": rtt}}

    return {"conditions": {"quiet": part(quiet), "hog": part(hog)}}


@pytest.mark.parametrize(
    "quiet,hog,rtt,failed",
    [
        (0.95, 0.90, 1.5, []),
        (
            0.949,
            0.95,
            1.0,
            ["quiet_throughput_1MiB", "quiet_throughput_4MiB", "quiet_throughput_64MiB"],
        ),
        (1.2, 0.899, 1.0, ["hog_throughput_1MiB", "hog_throughput_4MiB", "hog_throughput_64MiB"]),
        (1.0, 1.0, 1.51, ["quiet_rtt_8B", "hog_rtt_8B"]),
    ],
)
def test_goal_verdicts(quiet: float, hog: float, rtt: float, failed: list[str]) -> None:
    met = load().goals_met(report(quiet, hog, rtt))
    assert sorted(name for name, ok in met.items() if not ok) == sorted(failed)


def test_arguments() -> None:
    bench = load()
    assert bench.parse_args([]).condition_list == ["quiet", "hog"]
    assert bench.parse_args(["--conditions", "hog"]).condition_list == ["hog"]
    for bad in (["--conditions", "noisy"], ["--trials", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_size_subset_for_quick_comparisons() -> None:
    bench = load()
    assert bench.parse_args([]).size_list == ["1MiB", "4MiB", "64MiB"]
    # any order on the command line, the table's order in the report
    assert bench.parse_args(["--sizes", "64MiB,1MiB"]).size_list == ["1MiB", "64MiB"]
    for bad in (["--sizes", "2MiB"], ["--sizes", ","]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_verdicts_cover_only_what_was_measured() -> None:
    part = {"ratios": {"throughput_1MiB": 0.96}}
    met = load().goals_met({"conditions": {"quiet": part, "hog": {"ratios": {}}}})
    assert met == {"quiet_throughput_1MiB": True}


def test_a_comparison_against_another_build_is_no_goal() -> None:
    bench = load()
    report = {"conditions": {"quiet": {"ratios": {"throughput_1MiB": 1.0, "rtt_8B": 1.0,
                                                  "against_throughput_1MiB": 0.5}}}}  # fmt: skip
    assert bench.goals_met(report) == {"quiet_throughput_1MiB": True, "quiet_rtt_8B": True}


def test_the_pinned_conditions_are_accepted_and_carry_no_goal() -> None:
    bench = load()
    args = bench.parse_args(["--conditions", "hog,hog-apart,hog-shared"])
    assert args.condition_list == ["hog", "hog-apart", "hog-shared"]
    part = {"ratios": {"throughput_1MiB": 0.5, "rtt_8B": 9.0}}
    met = bench.goals_met({"conditions": {"hog-apart": part, "hog-shared": part}})
    assert met == {}


@pytest.mark.parametrize(
    "allowed,placement,hog_cpu,expected",
    [
        ({0, 1}, None, 0, None),
        ({1}, None, 0, None),  # unpinned: the hog's CPU is not looked at
        ({0, 1}, "apart", 0, {1}),
        ({0, 1, 2, 3}, "apart", 2, {0, 1, 3}),
        ({0, 1}, "shared", 1, {1}),
        ({0}, "apart", 0, ValueError),  # nothing left besides the hog's CPU
        ({0, 1}, "shared", 5, ValueError),  # not a CPU this process may use
    ],
)
def test_pinned_cpus(
    monkeypatch: pytest.MonkeyPatch,
    allowed: set[int],
    placement: str | None,
    hog_cpu: int,
    expected: Any,
) -> None:
    bench = load()
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: set(allowed))
    if expected is ValueError:
        with pytest.raises(ValueError):
            bench.pinned_cpus(placement, hog_cpu)
    else:
        assert bench.pinned_cpus(placement, hog_cpu) == expected


def test_a_measured_program_runs_on_the_cpus_it_is_pinned_to() -> None:
    cpu = min(os.sched_getaffinity(0))
    report_cpus = "import json, os; print(json.dumps({'cpus': sorted(os.sched_getaffinity(0))}))"
    answer = load().run_json([sys.executable, "-c", report_cpus], dict(os.environ), {cpu})
    assert answer == {"cpus": [cpu]}
