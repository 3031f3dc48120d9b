"""bench/coordinator_vs_commit.py's own arithmetic: which scrapes bound the throughput window,
and the new / old ratios (the runs themselves need two commits' coordinators and a quiet
machine: the benchmark's business, not a test's)."""

from __future__ import annotations

import asyncio
import itertools
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from bench_script_loader import load_bench_script

vs_commit = load_bench_script("coordinator_vs_commit.py")


def fake_benchmark(scrapes_during_phase: int) -> tuple[ModuleType, list[Any]]:
    """A benchmark module whose ``scrape`` returns numbered readings and whose ``saturate``
    scrapes ``scrapes_during_phase`` times (as a benchmark's progress logging might)."""
    bench = ModuleType("fake_coordinator_load")
    counter = itertools.count()
    readings: list[Any] = []

    def scrape(address: str, pid: int) -> Any:
        reading = SimpleNamespace(n=next(counter))
        readings.append(reading)
        return reading

    async def saturate(*_args: Any) -> None:
        for _ in range(scrapes_during_phase):
            bench.scrape("addr", 1)

    bench.scrape, bench.saturate = scrape, saturate
    return bench, readings


@pytest.mark.parametrize("during", [0, 1, 3])
def test_the_window_is_the_scrapes_right_around_saturate(during: int) -> None:
    bench, readings = fake_benchmark(during)
    identified = []
    recorder = vs_commit.WindowRecorder(
        bench, identify=lambda address, pid: identified.append(pid) or ({"pid": pid}, "info")
    )
    bench.scrape("addr", 7)  # the coordinator is up
    bench.scrape("addr", 7)  # just before the phase
    asyncio.run(bench.saturate(None, True, 1.0))
    bench.scrape("addr", 7)  # just after the phase
    bench.scrape("addr", 7)  # after the drain: not the window's
    assert identified == [7]  # identified once, at the first scrape
    assert recorder.before is readings[1]
    assert recorder.after is readings[2 + during]
    assert recorder.identity == {"pid": 7} and recorder.build_info == "info"


def run(code: str, build: str, events: float, wall_s: float, cpu_s: float) -> dict[str, Any]:
    row = {"code": code, "build": build, "events": events, "wall_s": wall_s}
    return vs_commit.with_rates(row | {"coordinator_cpu_s": cpu_s})


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (  # the new compiled build twice as fast per wall second, at the same CPU share
            [run("old", "interpreted", 100, 1, 1), run("new", "compiled", 200, 1, 1)],
            {"compiled": (2.0, 2.0)},
        ),
        (  # means over runs; per CPU-second differs when a coordinator idled
            [
                run("old", "interpreted", 100, 1, 1),
                run("old", "interpreted", 300, 1, 1),
                run("new", "interpreted", 200, 1, 0.5),
                run("new", "compiled", 400, 1, 1),
            ],
            {"compiled": (2.0, 2.0), "interpreted": (1.0, 2.0)},
        ),
        ([run("new", "compiled", 200, 1, 1)], {}),  # no old run: no ratio
    ],
)
def test_ratios_are_means_of_new_over_means_of_old(
    rows: list[dict[str, Any]], expected: dict[str, tuple[float, float]]
) -> None:
    got = vs_commit.ratios(rows)
    assert got.keys() == expected.keys()
    for build, pair in expected.items():
        assert got[build] == pytest.approx(pair), build
