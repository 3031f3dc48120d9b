"""bench/pd_reference.py's offline decode-ingress replays: one preemptive server, its orders
and its admission rules, on cases small enough to work out by hand (the simulator runs are the
benchmark's business, not a test's)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bench_script_loader import load_bench_script
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from flowsched.model import Flow, FlowClass

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "pd_reference.py"


ref = load_bench_script("pd_reference.py")

Jobs = dict[str, tuple[float, list[tuple[float, float]]]]
#: bytes per unit below (the replays count a request with less than a byte left as done)
MB = 1e6
#: request -> (deadline, [(release time, bytes)]) at RATE bytes/s. EDF serves V (due first)
#: until Z arrives; then V, Z and W cannot all make it: Z is late.
RATE = MB
THREE = {
    "V": (3.5, [(0.0, 3 * MB)]),
    "W": (5.0, [(0.0, 2 * MB)]),
    "Z": (4.5, [(2.0, 2 * MB)]),
}


def edf(jobs: Jobs) -> dict[str, float]:
    finish: dict[str, float] = ref.serve(jobs, RATE, lambda r: (jobs[r][0], r))
    return finish


@pytest.mark.parametrize(
    "schedule,finish",
    [
        # processor sharing: V and W halves until Z arrives at 2, thirds until W is done at
        # 5, then V and Z halves
        ("PS", {"V": 7.0, "W": 5.0, "Z": 7.0}),
        ("EDF", {"V": 3.0, "Z": 5.0, "W": 7.0}),
        # online: at Z's arrival V has 1 byte left, and Z is dropped (more bytes left than
        # V, both due no later than Z); V keeps what it got, W then meets its deadline
        ("online", {"V": 3.0, "W": 5.0, "Z": 7.0}),
        # retroactive: V (the most bytes in all) is dropped as if from its first byte, so the
        # 2 s it was served before Z arrived go to W
        ("retroactive", {"W": 2.0, "Z": 4.0, "V": 7.0}),
    ],
)
def test_ingress_schedules(schedule: str, finish: dict[str, float]) -> None:
    runs: dict[str, Callable[[], dict[str, float]]] = {
        "PS": lambda: ref.serve(THREE, RATE, None),
        "EDF": lambda: edf(THREE),
        "online": lambda: ref.serve_online_admission(THREE, RATE),
        "retroactive": lambda: ref.serve_with_admission(THREE, RATE),
    }
    assert runs[schedule]() == pytest.approx(finish)


def test_online_admission_forecasts_the_layers_still_to_come() -> None:
    # A's second part arrives later: at B's arrival the forecast counts it (A has 2.5 MB
    # left, B 2 MB), and A is dropped although A alone is on time so far
    jobs = {"A": (4.0, [(0.0, 1 * MB), (2.0, 2 * MB)]), "B": (3.0, [(0.5, 2 * MB)])}
    finish = ref.serve_online_admission(jobs, RATE)
    assert finish["B"] == pytest.approx(2.5)
    assert finish["A"] > jobs["A"][0]


@pytest.mark.parametrize("hash_seed", ["0", "1", "2", "3"])
def test_online_admission_breaks_ties_the_same_way_in_every_process(hash_seed: str) -> None:
    # A and B have the same bytes left when B arrives and one must go: the later deadline
    # (A) is dropped, whatever order the process's string hashing gives the set of requests
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('r', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "jobs = {'A': (4.0, [(0.0, 1e6), (2.0, 2e6)]), 'B': (3.5, [(0.5, 2.5e6)])}\n"
        "print(m.serve_online_admission(jobs, 1e6)['B'])\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(3.0)


_jobs = st.dictionaries(
    st.sampled_from("abcdef"),
    st.tuples(
        st.floats(0.5, 20.0),
        st.lists(
            st.tuples(st.floats(0.0, 10.0), st.floats(0.1 * MB, 5 * MB)), min_size=1, max_size=3
        ),
    ),
    min_size=1,
)


@settings(max_examples=200, deadline=None)
@given(_jobs)
def test_online_admission_drops_nothing_when_edf_meets_every_deadline(jobs: Jobs) -> None:
    """Removing work never delays preemptive EDF, so no forecast of the requests arrived so
    far can miss when the whole EDF schedule does not: the same finish times, every byte."""
    plain = edf(jobs)
    assume(all(plain[r] <= deadline - 1e-6 for r, (deadline, _) in jobs.items()))
    assert ref.serve_online_admission(jobs, RATE) == pytest.approx(plain)


@settings(max_examples=200, deadline=None)
@given(_jobs)
# found by Hypothesis: under sharing, b's first part ends one byte after a's and the remnant
# was dropped from its released bytes but not from what it had left, so b never finished
@example({"a": (1.0, [(0.0, 1e5), (1.0, 948575.0)]), "b": (1.0, [(0.0, 1e5 + 1), (1.0, 948576.0)])})
@example({"a": (1.0, [(0.0, 1e5)]), "b": (1.0, [(0.0, 1e5 + 1)])})  # a 1-byte remnant at the end
def test_every_schedule_serves_every_byte_by_the_same_makespan(jobs: Jobs) -> None:
    """All four are work conserving on one server: each request finishes, no earlier than its
    last release, and the last byte leaves at the same time whatever the order."""
    schedules = [
        ref.serve(jobs, RATE, None),
        edf(jobs),
        ref.serve_online_admission(jobs, RATE),
        ref.serve_with_admission(jobs, RATE),
    ]
    for finish in schedules:
        assert set(finish) == set(jobs)
        for request, (_, parts) in jobs.items():
            assert finish[request] >= max(t for t, _ in parts) - 1e-9
        # each request's last remnant of up to _DONE bytes counts as sent (float dust), so the
        # makespans may differ by that many bytes' time per request
        dust = len(jobs) * ref._DONE / RATE
        assert max(finish.values()) == pytest.approx(max(schedules[0].values()), abs=dust)


def _p2d(flow_id: int, request: str, deadline: float, layer: int, size: int, sent: int) -> Flow:
    return Flow(
        flow_id, FlowClass.KV, 0.0, size=size, sent=sent, deadline=deadline,
        consumer_index=layer, request=request,
    )  # fmt: skip


#: at t = 0, 4 layers, 1 byte/s: A is due at 10 with 1 + 3 x 2 = 7 bytes left (slack 3), B at
#: 12 with 1 + 2 x 1 = 3 bytes (its open layer 1 and layers 2-3; slack 9), C at 5 with 1 + 0
#: (slack 4), D was due at -1 (late: level 7). The collective goes on 0, the fetch on 1.
ORDERS = [
    _p2d(1, "A", 10.0, 0, 2, 1),
    _p2d(2, "B", 12.0, 0, 1, 1),  # sent: only B's layer 1 (flow 3) is still open
    _p2d(3, "B", 12.0, 1, 1, 0),
    _p2d(4, "C", 5.0, 3, 2, 1),
    _p2d(5, "D", -1.0, 3, 2, 0),
    Flow(6, FlowClass.TP, 0.0, size=8),
    Flow(7, FlowClass.KV_REUSE, 0.0, size=8),
]


@pytest.mark.parametrize(
    ("order", "levels"),
    [
        ("deadline", {1: 3, 2: 4, 3: 4, 4: 2}),  # C, A, B
        ("remaining", {1: 4, 2: 3, 3: 3, 4: 2}),  # C (1 byte), B (3), A (7)
        ("slack", {1: 2, 2: 4, 3: 4, 4: 3}),  # A (3), C (4), B (9)
    ],
)
def test_the_reference_ranks_the_p2d_by_its_order(order: str, levels: dict[int, int]) -> None:
    reference = ref.EdfRankReference(order=order, layers=4, rate=1.0)
    got = reference._levels(ORDERS, 0.0)
    assert got == {**levels, 5: 7, 6: 0, 7: 1}


# -- the offline optimum ------------------------------------------------------------------------


def full_rate(_link: str, start: float, end: float) -> float:
    return RATE * (end - start)


def as_demands(jobs: Jobs, links: tuple[str, ...] = ("L",)) -> dict[str, Any]:
    return {
        r: ref.P2dDemand(deadline, links, tuple(parts)) for r, (deadline, parts) in jobs.items()
    }


#: A crosses both links; B needs L1 in [0, 1], C needs L2 in [1, 2]. Each link alone could
#: serve all three (A on L1 in [1, 2], on L2 in [0, 1]), but A's bytes cross L1 and L2 at once
CROSSING = {
    "A": ref.P2dDemand(2.0, ("L1", "L2"), ((0.0, 1 * MB),)),
    "B": ref.P2dDemand(1.0, ("L1",), ((0.0, 1 * MB),)),
    "C": ref.P2dDemand(2.0, ("L2",), ((1.0, 1 * MB),)),
}


def busy_until_one(_link: str, start: float, end: float) -> float:
    return RATE * max(end - max(start, 1.0), 0.0)


@pytest.mark.parametrize(
    "demands,free,slot,most",
    [
        pytest.param(as_demands({"A": (2.0, [(0.0, MB)]), "B": (2.0, [(0.0, MB)])}), full_rate,
                     0.5, 2, id="both fit"),
        pytest.param(as_demands({"A": (1.0, [(0.0, MB)]), "B": (1.0, [(0.0, MB)])}), full_rate,
                     0.5, 1, id="one of two"),
        pytest.param(CROSSING, full_rate, 0.5, 2, id="a flow crosses its links at one rate"),
        # released at 0.5, due 1.2: 0.7 s for 1 s of bytes; 1 s slots count it from 0 to 2
        pytest.param(as_demands({"A": (1.2, [(0.5, MB)])}), full_rate, 0.1, 0, id="late release"),
        pytest.param(as_demands({"A": (1.2, [(0.5, MB)])}), full_rate, 1.0, 1,
                     id="a coarse slot favours the request"),
        pytest.param(as_demands({"A": (1.0, [(0.0, MB)])}), busy_until_one, 0.5, 0,
                     id="other traffic first"),
        pytest.param(as_demands({"A": (2.0, [(0.0, MB)])}), busy_until_one, 0.5, 1,
                     id="after the other traffic"),
        # 1.5 MB in 2 s would fit, but the second layer's 1 MB exists only from 1.5
        pytest.param(as_demands({"A": (2.0, [(0.0, MB / 2), (1.5, MB)])}), full_rate, 0.5, 0,
                     id="layers released over time"),
        pytest.param(as_demands({"A": (2.5, [(0.0, MB / 2), (1.5, MB)])}), full_rate, 0.5, 1,
                     id="layers in time"),
    ],
)  # fmt: skip
def test_offline_optimum(demands: dict[str, Any], free: Any, slot: float, most: int) -> None:
    count, chosen = ref.offline_optimum(demands, free, slot)
    assert count == most
    assert len(chosen) == most


def test_the_fractional_program_also_meets_two_of_the_crossing_three() -> None:
    fractional, _ = ref.offline_optimum(CROSSING, full_rate, 0.5, integer=False)
    assert fractional == 2  # x_A <= (1 - x_B) + (1 - x_C)
    assert ref.offline_optimum(CROSSING, full_rate, 0.5)[1] in ({"B", "C"}, {"A", "B"}, {"A", "C"})


@settings(max_examples=60, deadline=None)
@given(_jobs, st.sampled_from([0.25, 1.0]))
def test_no_schedule_on_one_link_meets_more_than_the_offline_optimum(
    jobs: Jobs, slot: float
) -> None:
    """EDF with and without admission are schedules on one link at RATE: each meets at most
    the optimum, whatever the slot (a coarser one only relaxes the program)."""
    most, _ = ref.offline_optimum(as_demands(jobs), full_rate, slot)
    for finish in (edf(jobs), ref.serve_with_admission(jobs, RATE)):
        on_time = sum(finish[r] <= deadline + 1e-9 for r, (deadline, _) in jobs.items())
        assert on_time <= most <= len(jobs)


def test_link_rates_integrate_the_rate_between_changes() -> None:
    rates = ref.LinkRates({"L": 10.0}, ["L"])
    rates.record(1.0, "L", 4.0)
    rates.record(1.0, "L", 5.0)  # the same instant: the later rate holds
    rates.record(3.0, "L", 5.0)  # no change
    rates.record(4.0, "L", 0.0)
    assert rates.sent("L", 0.0, 1.0) == 0.0
    assert rates.sent("L", 0.0, 10.0) == pytest.approx(15.0)
    assert rates.sent("L", 2.5, 4.5) == pytest.approx(7.5)


@pytest.mark.parametrize(("override", "expected"), [(None, "outstanding"), ("queued", "queued")])
def test_router_load_override(
    monkeypatch: pytest.MonkeyPatch, override: str | None, expected: str
) -> None:
    """``--router-load`` replaces the bundled scenario's router measure; without it the
    scenario's own stands."""
    monkeypatch.setattr(ref, "ROUTER_LOAD", override)
    serving = ref.load_scenario().serving
    assert serving is not None and serving.router_load == expected
