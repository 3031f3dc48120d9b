"""rmlq: levels (urgent tier, early, MLU bands), rho, Algorithm 1, promotion timers."""

from __future__ import annotations

import gc
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_flows import build_flow

from flowsched.model import Context, Flow, FlowClass
from flowsched.policies import create, feasibility, rmlq
from flowsched.policies.common import TrafficMeter

B = 1e9  # bytes/s of the default link in these tests


def ctx(now: float = 0.0, **fields: Any) -> Context:
    fields.setdefault("default_bandwidth", B)
    return Context(now=now, **fields)


def policy(num_levels: int = 8, **args: Any) -> rmlq.RmlqPolicy:
    """rmlq with ``args``; the deferred bands by MLU (the paper's Q_i, which most tests here
    check) unless ``deferred_order`` is given (the code default is deadline order)."""
    args.setdefault("deferred_order", "mlu")
    made = create("rmlq", args, num_levels=num_levels)
    assert isinstance(made, rmlq.RmlqPolicy)
    return made


# Defaults K=8, T=2, R=3, E=4, U=0.5: 0/1 = urgent (MLU >= 0.5) with time left <= 25 ms /
# more; 2 = tp; 3 = other RLI 0; 4 = RLI >= 1; 5 = MLU in [0.125, 0.5); 6 = below;
# 7 = scavenger. MLU = remaining / (time left x 1e9 B/s) (no links: rho 0).
@pytest.mark.parametrize(
    ("remaining", "deadline", "args", "level"),
    [
        (6e8, 1.0, {}, 1),
        (5e8, 1.0, {}, 1),
        (4.99e8, 1.0, {}, 5),
        (1.25e8, 1.0, {}, 5),
        (1e8, 1.0, {}, 6),
        (0, 1.0, {}, 6),
        (2e7, 0.04, {}, 1),
        (1e7, 0.02, {}, 0),
        (2e7, 0.04, {"urgent_levels": 3}, 1),
        (3e7, 0.06, {"urgent_levels": 3}, 2),
        (1e3, -0.5, {}, 7),
        (1e3, -0.5, {"feasibility": False}, 0),
        (6e8, 1.0, {"urgent_levels": 1, "early_levels": 2}, 0),
    ],
    ids=[
        "mlu-0.6-urgent-far",
        "mlu-0.5-urgent-inclusive",
        "mlu-0.499-band1",
        "mlu-0.125-band1-inclusive",
        "mlu-0.1-band2",
        "finished-lowest",
        "urgent-40ms-left",
        "urgent-20ms-left",
        "three-urgent-40ms",
        "three-urgent-60ms",
        "late-pruned",
        "late-without-pruning-on-top",
        "one-urgent-level",
    ],
)
def test_explicit_flow_level(
    remaining: float, deadline: float, args: dict[str, Any], level: int
) -> None:
    flow = build_flow(cls="kv", size=int(remaining), deadline=deadline)
    assert policy(**args).admit(flow, ctx()).level == level


@pytest.mark.parametrize(
    ("value", "time_left", "level"),
    [(1.0, 1.0, 1), (0.5, 0.05, 1), (0.5, 0.025, 0), (0.5, -1.0, 0), (0.3, 0.0, 5), (0.01, 0, 6)],
    ids=["urgent-rest", "urgent-50ms", "urgent-25ms", "urgent-late", "band1", "band2"],
)
def test_mlu_level_table(value: float, time_left: float, level: int) -> None:
    assert policy().mlu_level(value, time_left) == level


def test_urgent_order_by_slack() -> None:
    # 3.5e7 bytes on 1e9 B/s need 35 ms (MLU 0.5): 70 ms left is 35 ms of slack (level 1 in
    # slack order, level 2 in deadline order)
    flow = build_flow(cls="kv", size=int(3.5e7), deadline=0.07)
    assert policy(urgent_levels=3, urgent_order="slack").admit(flow, ctx()).level == 1
    assert policy(urgent_levels=3).admit(flow, ctx()).level == 2


def test_top_threshold_and_band_parameters() -> None:
    # K=9 -> bands at 5, 6, 7; top 1.0, E=2, U=1 -> [0.5, 1), [0.25, 0.5), below
    custom = policy(9, E=2.0, U=1.0, top_threshold=1.0)
    assert [custom.mlu_level(v) for v in (1.0, 0.7, 0.3, 0.2)] == [1, 5, 6, 7]


def test_mlu_formula() -> None:
    assert rmlq.mlu(1e9, 2.0, 1e9, 0.5) == pytest.approx(1.0)
    assert rmlq.mlu(0, 1.0, 1e9, 0.0) == 0.0
    assert rmlq.mlu(1, 0.0, 1e9, 0.0) == float("inf")


@pytest.mark.parametrize(
    ("cls", "consumer", "current", "args", "level"),
    [
        ("tp", None, None, {}, 2),
        ("experience", 5, 5, {}, 3),
        ("experience", 6, 5, {}, 4),
        ("kv_reuse", 9, None, {}, 4),
        ("bulk", None, None, {}, 7),
        ("tp", None, None, {"collectives_first": False, "early_levels": 4}, 2),
        ("experience", 5, 5, {"collectives_first": False, "early_levels": 4}, 2),
        ("experience", 6, 5, {"collectives_first": False, "early_levels": 4}, 3),
        ("experience", 9, 5, {"collectives_first": False, "early_levels": 4}, 5),
        ("kv_reuse", 4, 5, {"collectives_first": False, "early_levels": 4}, 2),
    ],
    ids=[
        "tp-alone",
        "rli0-below-tp",
        "rli1-on-the-last-early-level",
        "no-job-index-unknown-level",
        "bulk",
        "shared-tp",
        "shared-rli0",
        "rli1",
        "rli3-capped",
        "consumer-passed",
    ],
)
def test_implicit_flow_level_from_rli(
    cls: str, consumer: int | None, current: int | None, args: dict[str, Any], level: int
) -> None:
    flow = build_flow(cls=cls, job="j", consumer_index=consumer)
    job_index = {} if current is None else {"j": current}
    num_levels = 9 if "early_levels" in args else 8
    assert policy(num_levels, **args).admit(flow, ctx(job_index=job_index)).level == level


@pytest.mark.parametrize(
    ("job_index", "size", "level"),
    [({"j": 3}, 6e8, 5), ({}, 6e8, 1), ({"j": 3}, 1e8, 6), ({"other": 3}, 6e8, 1)],
    ids=["in-prefill-held", "prefill-done-urgent", "in-prefill-deferred", "other-job-running"],
)
def test_p2d_of_a_job_in_prefill_stays_below_its_collectives(
    job_index: dict[str, int], size: float, level: int
) -> None:
    flow = build_flow(cls="kv", size=int(size), deadline=1.0, job="j", consumer_index=2)
    assert policy().admit(flow, ctx(job_index=job_index)).level == level


def test_unknown_size_or_deadline_uses_unknown_level() -> None:
    assert policy().admit(build_flow(cls="kv", deadline=1.0), ctx()).level == 4
    assert policy().admit(build_flow(cls="param_sync", size=10), ctx()).level == 4
    assert policy(unknown_level=6).admit(build_flow(cls="kv"), ctx()).level == 6


def test_promotion_as_deadline_nears() -> None:
    # 1e8 bytes due at t=1: MLU 0.1 at t=0 (6), 0.2 at 0.5 (5), 0.67 at 0.85 (urgent, 150 ms
    # left: 1), still 1 with 40 ms left, 0 with 20 ms left (no pruning: nothing is sent here,
    # so Algorithm 1 would rightly find it hopeless)
    pol = policy(feasibility=False)
    flow = build_flow(cls="kv", size=int(1e8), deadline=1.0)
    flow.level = pol.admit(flow, ctx(0.0)).level
    assert flow.level == 6
    seen = []
    for now in (0.5, 0.85, 0.96, 0.98):
        for fid, decision in pol.reevaluate([flow], ctx(now)).items():
            assert fid == flow.flow_id
            flow.level = decision.level
        seen.append(flow.level)
    assert seen == [5, 1, 1, 0]


@pytest.mark.parametrize(
    ("lead", "now", "level"),
    [(0.0, 0.5, 5), (0.3, 0.5, 1), (0.3, 0.0, 5), (0.0, 0.0, 6), (0.3, 0.71, 0), (0.0, 0.71, 5)],
    ids=["no-lead", "lead-promotes", "lead-band", "no-lead-band2", "inside-lead", "no-lead-0.71"],
)
def test_promotion_lead_counts_the_actuation_delay(lead: float, now: float, level: int) -> None:
    # 1e8 bytes due at t=1 on 1e9 B/s: MLU = 1e8 / ((1 - now - lead) x 1e9)
    flow = build_flow(cls="kv", size=int(1e8), deadline=1.0)
    assert policy(promotion_lead=lead).admit(flow, ctx(now)).level == level


def test_never_demotes_when_urgency_drops() -> None:
    pol = policy()
    flow = build_flow(cls="kv", size=int(6e8), deadline=1.0)
    flow.level = pol.admit(flow, ctx()).level
    assert flow.level == 1
    flow.sent = flow.size or 0  # nothing left: MLU 0 would be the lowest band
    assert pol.reevaluate([flow], ctx(0.1)) == {}
    exp = build_flow(2, cls="experience", job="j", consumer_index=6)
    exp.level = pol.admit(exp, ctx(job_index={"j": 6})).level
    assert exp.level == 3
    assert pol.reevaluate([exp], ctx(job_index={"j": 0})) == {}


# -- rho ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "rho_band1", "rho_band2"),
    [("above", 0.5, 0.8), ("others", 0.6, 0.8), ("link", 0.9, 0.9), ("none", 0.0, 0.0)],
)
def test_rho_sources(source: str, rho_band1: float, rho_band2: float) -> None:
    # On link a for 1 s (window 10 ms: converged): tp (level 3) at 50%, a kv flow in band 1
    # (level 5) at 30%, a kv flow in band 2 (level 6) at 10%.
    pol = policy(rho_source=source, rho_window=0.01, feasibility=False)
    flows = [
        build_flow(1, cls="tp", size=10**12, links=("a",)),
        build_flow(2, cls="kv", size=10**12, deadline=100.0, links=("a",)),
        build_flow(3, cls="kv", size=10**12, deadline=100.0, links=("a",)),
    ]
    for flow, level, share in zip(flows, (3, 5, 6), (0.5, 0.3, 0.1), strict=True):
        pol.admit(flow, ctx(0.0))
        flow.level, flow.sent = level, int(share * B)
    pol.reevaluate(flows, ctx(1.0))
    assert pol._rho(flows[1], ctx(1.0)) == pytest.approx(rho_band1, abs=1e-6)
    assert pol._rho(flows[2], ctx(1.0)) == pytest.approx(rho_band2, abs=1e-6)


def test_admission_counts_the_load_above_the_deferred_bands() -> None:
    pol = policy(rho_window=0.01, feasibility=False)
    tp = build_flow(1, cls="tp", size=10**12, links=("a",))
    pol.admit(tp, ctx(0.0))
    tp.level, tp.sent = 3, int(0.5 * B)
    pol.reevaluate([tp], ctx(1.0))
    # 1.5e8 bytes in 1 s: MLU 0.15 on the whole link, 0.3 with the collectives' half taken
    flow = build_flow(2, cls="kv", size=int(1.5e8), deadline=2.0, links=("a",))
    assert pol.flow_mlu(flow, ctx(1.0)) == pytest.approx(0.3)
    assert pol.admit(flow, ctx(1.0)).level == 5


def test_rho_is_capped_at_max_load() -> None:
    pol = policy(rho_source="link", rho_window=0.01, max_load=0.8)
    hog = build_flow(9, cls="bulk", size=10**12, links=("a",))
    pol.admit(hog, ctx(0.0))
    hog.sent = int(B * 1.0)  # the link full for 1 s
    pol.reevaluate([hog], ctx(1.0))
    flow = build_flow(cls="kv", size=int(1e8), deadline=2.0, links=("a",))
    assert pol.flow_mlu(flow, ctx(1.0)) == pytest.approx(1e8 / (1.0 * B * 0.2))


def test_traffic_meter_loads_per_level() -> None:
    meter = TrafficMeter(window=1e-9)
    flows = [build_flow(i, size=10**12, links=("a", "b")) for i in range(3)]
    for flow, level in zip(flows, (0, 2, -1), strict=True):
        meter.open(flow, 0.0)
        flow.level = level
        flow.sent = int(0.1 * B)
    meter.update(flows, ctx(1.0))
    assert [meter.load_above("a", level) for level in (0, 1, 2, 3)] == pytest.approx(
        [0.0, 0.1, 0.1, 0.2]
    )
    assert meter.link_load("b") == pytest.approx(0.3)  # the unplaced flow counts on the link


def _rho_after(history: list[tuple[float, float, float]], window: float = 0.05) -> float:
    """rho ("others") of flow 1 on link a after ``history``: (duration, own share, other share).

    Flow 2 carries the other traffic; both report progress at the end of each period, and
    Context.link_load always claims a saturated link (it must not matter).
    """
    pol = policy(rho_source="others", rho_window=window, max_load=0.99)
    mine = build_flow(1, cls="param_sync", size=10**13, deadline=100.0, links=("a",))
    other = build_flow(2, cls="tp", size=10**13, links=("a",))
    noisy = {"link_load": {"a": 1.0}}
    now = 0.0
    for flow in (mine, other):
        flow.level = pol.admit(flow, ctx(now, **noisy)).level
    for duration, own, rest in history:
        mine.sent += int(own * B * duration)
        other.sent += int(rest * B * duration)
        now += duration
        pol.reevaluate([mine, other], ctx(now, **noisy))
    return pol._rho(mine, ctx(now, **noisy))


@pytest.mark.parametrize(
    ("history", "rho"),
    [
        ([], 0.0),
        ([(1.0, 1.0, 0.0)], 0.0),
        ([(1.0, 0.5, 0.5)], 0.5),
        ([(1.0, 0.25, 0.75)], 0.75),
        ([(1.0, 0.9, 0.1), (0.001, 0.0, 1.0)], 0.1 + 0.9 * (1 - math.exp(-0.02))),
        ([(1.0, 0.9, 0.1)] + [(0.0001, 0.0, 1.0)] * 10, 0.1 + 0.9 * (1 - math.exp(-0.02))),
        # steady state of 2.5 ms bursts every 24.5 ms: (0.1 + b (0.9 - a)) / (1 - a b) = 0.173
        # with a = exp(-2.5/50), b = exp(-22/50) (the duty-cycle mean is 0.19)
        ([(1.0, 0.9, 0.1)] + [(0.0025, 0.0, 1.0), (0.022, 0.9, 0.1)] * 8, 0.173),
    ],
    ids=[
        "admission-ignores-context-burst",
        "alone-on-the-link",
        "fair-half",
        "quarter-share",
        "1ms-starvation-barely-moves-rho",
        "same-split-into-10-evaluations",
        "periodic-tp-bursts-read-as-duty-cycle",
    ],
)
def test_rho_others_is_the_windowed_load_of_the_other_flows(
    history: list[tuple[float, float, float]], rho: float
) -> None:
    assert _rho_after(history) == pytest.approx(rho, abs=0.02)


def test_traffic_meter_counts_every_byte_once_whoever_is_passed() -> None:
    meter = TrafficMeter(window=1e-9)  # window ~0: the averages are the last interval's rates
    early = build_flow(1, size=10**12, links=("a",))
    late = build_flow(2, size=10**12, links=("a",))
    meter.open(early, 0.0)
    meter.update([early], ctx(0.0))
    meter.open(late, 0.9)  # opened mid-interval: its rate is over its own 0.1 s
    early.sent, late.sent = int(1e8), int(1e8)
    meter.update([early, late], ctx(1.0))
    assert meter.flow_rate(early) == pytest.approx(1e8)
    assert meter.flow_rate(late) == pytest.approx(1e9)
    assert meter.link_load("a") == pytest.approx(2e8 / B)
    late.sent += int(5e8)  # a subset update leaves the late flow's bytes for later ...
    meter.update([early], ctx(2.0))
    assert meter.link_load("a") == pytest.approx(0.0)
    meter.close(late)  # ... and closing it counts them
    meter.update([early], ctx(3.0))
    assert meter.link_load("a") == pytest.approx(5e8 / B)
    assert meter.others_load(early, ctx(3.0)) == pytest.approx(0.5)


@pytest.mark.parametrize("flow_rates", [False, True], ids=["links-only", "with-flow-rates"])
def test_traffic_meter_leaves_no_young_objects_per_report(flow_rates: bool) -> None:
    # The coordinator folds every progress report into the meter. Replacing a per-flow
    # (when, sent) tuple on each report kept the collector's young-generation count flat
    # (each new tuple's +1 undone by the freed one's -1) while a young tuple per flow piled
    # up: the next generation-0 collection then traversed 10,000 of them (ms pauses).
    meter = TrafficMeter(window=0.05, flow_rates=flow_rates)
    flows = [build_flow(i, size=10**12, links=("a",)) for i in range(2000)]
    for flow in flows:
        flow.level = 2
        meter.open(flow, 0.0)
    meter.update(flows, ctx(0.001))
    for flow in flows:  # the first bytes at a level build that flow's (link, level) keys once
        flow.sent += 1000
    meter.update(flows, ctx(0.002))
    gc.collect()
    gc.disable()
    try:
        young_before = len(gc.get_objects(0))
        for step in range(3, 7):
            for flow in flows:
                flow.sent += 1000
            meter.update(flows, ctx(step * 0.001))
        young_after = len(gc.get_objects(0))
    finally:
        gc.enable()
    assert young_after - young_before < 100, (young_before, young_after)
    assert meter.link_load("a") > 0


def test_starved_flow_is_not_promoted_by_a_burst() -> None:
    # The bug this guards against: the own share measured since the previous evaluation
    # (< 1 ms) read a flow briefly starved by a TP burst as rho = max_load: MLU x10 and, since
    # rmlq never demotes, level 0 for good.
    pol = policy(rho_source="others", rho_window=0.05)
    sync = build_flow(1, cls="param_sync", size=int(1e9), deadline=4.0, links=("a",))
    other = build_flow(2, cls="tp", size=10**12, links=("a",))
    for flow in (sync, other):
        flow.level = pol.admit(flow, ctx(0.0, link_load={"a": 0.92})).level
    assert sync.level == 5  # MLU 1e9 / (4 s x 1e9 B/s) = 0.25: band [0.125, 0.5)
    sync.sent = other.sent = int(0.25e9)  # half the link each for 0.5 s
    assert pol.reevaluate([sync, other], ctx(0.5)) == {}  # MLU 0.75e9 / (3.5e9 x 0.5) = 0.43
    other.sent += int(1e6)  # a 1 ms burst of the other flow; the sync sends nothing
    assert pol.reevaluate([sync, other], ctx(0.501, link_load={"a": 1.0})) == {}
    assert pol.flow_mlu(sync, ctx(0.501)) == pytest.approx(0.43, abs=0.01)


@pytest.mark.parametrize(
    ("deadlines", "red", "loose"),
    [
        ([3.0], 3.0, 3.0),
        ([1.0, 2.0, 10.0, 11.0], 5.5, 10.0),
        ([1.0, 1.1, 1.2, 5.0], 2.0, 5.0),
        ([2.0, 2.0], 2.0, 2.0),
        # f counts requests, repeats included (the paper's fraction of tight requests): 4 of 5
        ([1.0, 1.0, 1.0, 1.0, 10.0], 0.8 * 1.0 + 0.2 * 10.0, 10.0),
        ([1.0, 2.0, 10.0, 10.0], 0.5 * 1.0 + 0.5 * 10.0, 10.0),
    ],
    ids=["single", "two-two", "three-one", "equal", "repeated-tight", "repeated-loose"],
)
def test_robust_effective_deadline(deadlines: list[float], red: float, loose: float) -> None:
    assert rmlq.robust_effective_deadline(deadlines) == pytest.approx(red)
    assert feasibility.loose_deadline(deadlines) == pytest.approx(loose)


def test_red_orders_equal_rli_flows_across_requests() -> None:
    # K=12, T=2, R=5, no collectives_first: slots RLI0/tight=2, RLI0/loose=3, RLI1/tight=4,
    # RLI1/loose=5, rest=6
    pol = policy(12, early_levels=5, red_tiers=2, collectives_first=False)
    tight, loose = "r-tight", "r-loose"
    flows = [
        build_flow(1, cls="tp", request=tight, deadline=1.0),
        build_flow(2, cls="tp", request=loose, deadline=2.0),
        build_flow(3, cls="kv_reuse", request=tight, deadline=1.0, job="j", consumer_index=1),
        build_flow(4, cls="kv_reuse", request=loose, deadline=2.0, job="j", consumer_index=1),
        build_flow(5, cls="kv_reuse", request=loose, deadline=2.0, job="j", consumer_index=3),
        build_flow(6, cls="tp"),
    ]
    decisions = pol.reevaluate(flows, ctx(job_index={"j": 0}))
    assert {fid: d.level for fid, d in decisions.items()} == {1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 2}


def test_a_new_request_starts_in_the_loosest_red_tier_and_is_promoted_if_tight() -> None:
    # as above: admitted before any ranking, both RLI-1 fetches take the loose slot (5); the
    # next evaluation ranks the requests and lifts the tight one's (4): a flow is never moved
    # down, so one admitted in the tight tier stayed there however loose its request
    pol = policy(12, early_levels=5, red_tiers=2, collectives_first=False)
    index = {"j": 0}
    flows = [
        build_flow(1, cls="kv_reuse", request="r-tight", deadline=1.0, job="j", consumer_index=1),
        build_flow(2, cls="kv_reuse", request="r-loose", deadline=2.0, job="j", consumer_index=1),
    ]
    for flow in flows:
        flow.level = pol.admit(flow, ctx(job_index=index)).level
    assert [flow.level for flow in flows] == [5, 5]
    decisions = pol.reevaluate(flows, ctx(0.001, job_index=index))
    assert {fid: d.level for fid, d in decisions.items()} == {1: 4}


# -- Algorithm 1 ----------------------------------------------------------------------------


def demand(request: str, deadline: float, size: float, batch: str | None = None) -> Any:
    return feasibility.Demand(request, batch or request, deadline, {"u": size})


@pytest.mark.parametrize(
    ("demands", "budget", "compute", "pruned"),
    [
        ([demand("A", 1.0, 5e8), demand("B", 1.2, 6e8), demand("C", 1.3, 1e8)], 1, {}, []),
        ([demand("A", 1.0, 5e8), demand("B", 1.2, 9e8), demand("C", 1.3, 1e8)], 1, {}, ["B"]),
        ([demand("A", 1.0, 5e8), demand("B", 1.2, 9e8)], 0, {}, []),
        ([demand("A", 1.0, 9e8), demand("B", 1.0, 2e8)], 1, {}, ["A"]),
        ([demand("A", 0.8, 4e8)], 1, {"A": 0.5}, ["A"]),
        ([demand("A", 0.8, 4e8)], 1, {"A": 0.3}, []),
        (
            [demand("A", 1.0, 6e8), demand("B", 1.0, 6e8), demand("C", 1.0, 6e8)],
            2,
            {},
            ["A", "B"],  # equal loads: the first (the more urgent) goes first
        ),
        # one batch, two requests: RED over 1.0 and 3.0; the loose deadline 3.0 is the check
        ([demand("r1", 1.0, 2e9, "J"), demand("r2", 3.0, 5e8, "J")], 1, {}, []),
        # B (RED 0.06) cannot make it and goes; A (RED 0.055), walked before, met its own
        # check (75 ms by its loose 0.1) and keeps its requests however large the budget
        (
            [demand("a1", 0.01, 5e6, "A"), demand("a2", 0.1, 7e7, "A"), demand("b1", 0.06, 2e8)],
            2,
            {},
            ["b1"],
        ),
    ],
    ids=[
        "all-fit",
        "prune-the-batch-itself",
        "no-budget",
        "prune-a-more-urgent-batch",
        "compute-makes-it-late",
        "compute-fits",
        "budget-two",
        "batch-judged-by-its-loose-deadline",
        "stops-once-the-judged-batch-is-gone",
    ],
)
def test_algorithm_1(
    demands: list[Any], budget: int, compute: dict[str, float], pruned: list[str]
) -> None:
    assert feasibility.inter_scheduling(demands, lambda _: B, 0.0, budget, compute) == pruned


@pytest.mark.parametrize(("budget", "level"), [(1, 7), (0, 1)])
def test_algorithm_1_prunes_requests_in_the_policy(budget: int, level: int) -> None:
    # on one 1e9 B/s link: r1 needs 0.5 s by 1.0, r2 0.9 s more by 1.2: r2 cannot make it
    pol = policy(drop_budget=budget)
    first = build_flow(1, cls="kv", size=int(5e8), deadline=1.0, request="r1")
    second = build_flow(2, cls="kv", size=int(9e8), deadline=1.2, request="r2")
    collective = build_flow(3, cls="tp", request="r2")
    for flow in (first, second, collective):
        flow.level = pol.admit(flow, ctx()).level
    decisions = pol.reevaluate([first, second, collective], ctx(0.001))
    assert decisions.get(2, rmlq.Decision(second.level)).level == level
    assert 1 not in decisions and 3 not in decisions  # r1 and the collective keep theirs


def _learn_depth(pol: rmlq.RmlqPolicy, layers: int) -> None:
    """Let ``pol`` see a finished request's last layer (the model depth it learns)."""
    deepest = build_flow(99, cls="kv", size=10, deadline=9.0, request="old",
                         consumer_index=layers - 1)  # fmt: skip
    pol.admit(deepest, ctx())
    pol.release(deepest, ctx())


def test_algorithm_1_counts_the_layers_not_opened_and_the_remaining_compute() -> None:
    # a 4-layer job (depth learned from a finished request's layer 3) at layer 1 going at
    # 0.1 s per layer: 0.2 s of compute left; its request's layer-1 P2D of 2e8 bytes (MLU 0.5:
    # at its promotion point, held below the collectives) alone would be done at 0.3 s, but
    # with layers 2 and 3 it is 6e8 bytes: 0.8 s at the earliest, deadline 0.4
    pol = policy()
    _learn_depth(pol, 4)
    flow = build_flow(1, cls="kv", size=int(2e8), deadline=0.4, job="j", request="r",
                      consumer_index=1)  # fmt: skip
    flow.level = pol.admit(flow, ctx(0.0, job_index={"j": 0})).level
    assert flow.level == 5  # held below the collectives
    pol.reevaluate([flow], ctx(0.0, job_index={"j": 0}))  # the job's pace starts here
    pol._alg1_due = True  # as if another request arrived
    assert pol.reevaluate([flow], ctx(0.1, job_index={"j": 1}))[1].level == 7
    alone = policy()  # the same request without job progress: judged on its bytes alone
    flow = build_flow(1, cls="kv", size=int(2e8), deadline=0.4, request="r")
    flow.level = alone.admit(flow, ctx()).level
    assert alone.reevaluate([flow], ctx(0.1)) == {}


def test_algorithm_1_counts_one_layers_bytes_per_layer_not_opened() -> None:
    # an 8-layer job at layer 4, 1 ms per layer: 3 ms of compute left. Its request has layers
    # 2-4 open (1e7 bytes each) and 5-7 to come: 6e7 bytes, 63 ms in all against a 90 ms
    # deadline. Counted as the open bytes times the layers left (1.2e8) it looked lost.
    pol = policy(mlu_scope="request", pace_layers=0, rho_source="none", alg1_interval=0.0)
    _learn_depth(pol, 8)
    flows = [
        build_flow(
            i, cls="kv", size=int(1e7), deadline=0.09, job="j", request="r", consumer_index=i
        )
        for i in (2, 3, 4)
    ]
    for flow in flows:
        flow.level = pol.admit(flow, ctx(0.0, job_index={"j": 3})).level
    pol.reevaluate(flows, ctx(0.0, job_index={"j": 3}))  # the job's pace starts here
    pol._alg1_due = True  # as if another request arrived
    assert all(d.level != 7 for d in pol.reevaluate(flows, ctx(0.001, job_index={"j": 4})).values())
    assert "r" not in pol._pruned


def test_late_requests_are_pruned_but_not_their_collectives_or_param_syncs() -> None:
    pol = policy()
    flows = [
        build_flow(1, cls="kv", size=10, deadline=1.0, request="r"),
        build_flow(2, cls="tp", request="r"),
        build_flow(3, cls="param_sync", size=10, deadline=1.0),
    ]
    for flow in flows:
        flow.level = pol.admit(flow, ctx()).level
    decisions = pol.reevaluate(flows, ctx(1.5))
    assert {fid: d.level for fid, d in decisions.items()} == {1: 7, 3: 0}


def test_mlu_check_prunes_a_hopeless_request_after_its_grace() -> None:
    pol = policy(feasibility_check="mlu", feasibility_grace=0.01)
    hopeless = build_flow(1, cls="kv", size=int(2e9), deadline=1.0, request="r")  # MLU 2
    sibling = build_flow(2, cls="kv", size=int(1e6), deadline=1.0, request="r")
    for flow in (hopeless, sibling):
        flow.level = pol.admit(flow, ctx()).level
    assert not pol.per_flow_decisions
    assert pol.reevaluate([hopeless, sibling], ctx(0.005)) == {}
    decisions = pol.reevaluate([hopeless, sibling], ctx(0.02))
    assert {fid: d.level for fid, d in decisions.items()} == {1: 7, 2: 7}


@pytest.mark.parametrize(
    ("args", "per_flow"),
    [
        ({}, True),
        ({"feasibility": False}, True),
        ({"feasibility_check": "mlu"}, False),
        ({"feasibility_check": "mlu", "feasibility": False}, True),
        ({"red_tiers": 2, "feasibility": False}, False),
    ],
    ids=["alg1", "off", "mlu", "mlu-off", "red"],
)
def test_per_flow_decisions(args: dict[str, Any], per_flow: bool) -> None:
    assert policy(12, early_levels=5, **args).per_flow_decisions is per_flow


# on one 1e9 B/s link: r1 needs 0.5 s by 1.0, r2 0.9 s more by 1.2 (Algorithm 1 prunes r2);
# with the "mlu" check r2's first flow alone turns hopeless (MLU 0.9 at 0, 1.125 at 0.2)
@pytest.mark.parametrize("check", ["alg1", "mlu"])
@pytest.mark.parametrize("released", [False, True], ids=["kept", "released"])
def test_pruning_moves_the_request_flows_not_passed(check: str, released: bool) -> None:
    pol = policy(feasibility_check=check)
    first = build_flow(1, cls="kv", size=int(5e8), deadline=1.0, request="r1")
    deadline = 1.2 if check == "alg1" else 1.0
    second = build_flow(2, cls="kv", size=int(9e8), deadline=deadline, request="r2")
    untouched = build_flow(4, cls="kv", size=int(1e6), deadline=5.0, request="r2")
    collective = build_flow(3, cls="tp", request="r2")
    flows = [first, second, untouched, collective]
    for flow in flows:
        flow.level = pol.admit(flow, ctx()).level
    assert 5 <= untouched.level < 7  # deferred (its request's bytes count: band 5 or 6)
    if released:
        pol.release(untouched, ctx())
    decisions = pol.reevaluate([first, second] if check == "alg1" else [second], ctx(0.2))
    expected = {2: 7} if released else {2: 7, 4: 7}  # not r1, not the collective
    assert {fid: d.level for fid, d in decisions.items()} == expected
    untouched.level = second.level = 7
    assert pol.reevaluate([first, second], ctx(0.201)) == {}  # moved once, not at every call


# -- the pace check --------------------------------------------------------------------------


# A 32-layer model; request r's layer i (1e6 bytes: 1 ms at B) opens at opens[i]. At its fastest
# step of 10 ms, its last layer opens 27 steps after layer 4 and is across 1 ms later.
_STEADY = [0.01 * i for i in range(6)]
_SLOW_START = [0.0, 0.03, 0.04, 0.05, 0.06, 0.07]


@pytest.mark.parametrize(
    ("opens", "deadline", "args", "pruned_at"),
    [
        (_STEADY, 0.3, {}, 4),  # last layer across at 0.04 + 0.27 + 0.001 > 0.3
        (_STEADY, 0.3105, {}, 4),
        (_STEADY, 0.3115, {}, None),
        (_STEADY[:4], 0.3, {}, None),  # three steps seen: not judged yet
        (_STEADY, 0.3, {"pace_layers": 2}, 2),  # 0.02 + 0.29 + 0.001 > 0.3
        (_STEADY, 0.3, {"pace_layers": 0}, None),
        (_STEADY, 0.3, {"feasibility": False}, None),
        (_SLOW_START, 0.34, {}, None),  # fastest step 10 ms: 0.06 + 0.27 + 0.001 <= 0.34
        (_SLOW_START, 0.33, {}, 4),
    ],
    ids=[
        "doomed",
        "doomed-by-the-last-layer-bytes",
        "just-in-time",
        "too-few-layers",
        "judged-after-two",
        "off",
        "no-feasibility",
        "fastest-step-not-the-mean",
        "slow-start-doomed",
    ],
)
def test_pace_check_prunes_a_request_whose_last_layer_comes_too_late(
    opens: list[float], deadline: float, args: dict[str, Any], pruned_at: int | None
) -> None:
    pol = policy(**args)
    _learn_depth(pol, 32)
    levels = []
    for layer, now in enumerate(opens):
        flow = build_flow(layer + 1, cls="kv", size=int(1e6), deadline=deadline, request="r",
                          consumer_index=layer, opened_at=now)  # fmt: skip
        levels.append(pol.admit(flow, ctx(now)).level)
    first_pruned = next((i for i, level in enumerate(levels) if level == 7), None)
    assert first_pruned == pruned_at
    assert all(level == 7 for level in levels[first_pruned or len(levels) :])


def test_pace_check_moves_the_request_layers_already_open() -> None:
    pol = policy()
    _learn_depth(pol, 32)
    other = build_flow(50, cls="kv", size=int(1e6), deadline=5.0, request="q", consumer_index=0)
    other.level = pol.admit(other, ctx()).level
    flows = []
    for layer, now in enumerate(_STEADY[:5]):
        flow = build_flow(layer + 1, cls="kv", size=int(1e6), deadline=0.3, request="r",
                          consumer_index=layer, opened_at=now)  # fmt: skip
        flow.level = pol.admit(flow, ctx(now)).level
        flows.append(flow)
    assert flows[-1].level == 7
    decisions = pol.reevaluate([], ctx(0.041))
    assert {fid: d.level for fid, d in decisions.items()} == {1: 7, 2: 7, 3: 7, 4: 7}


def test_pace_check_forgets_a_request_after_its_memory() -> None:
    pol = policy(request_memory=0.5)
    flow = build_flow(1, cls="kv", size=10, deadline=5.0, request="r", consumer_index=0)
    pol.admit(flow, ctx())
    pol.release(flow, ctx(0.1))
    pol.reevaluate([], ctx(0.5))
    assert "r" in pol._layer_pace  # a later layer may still come
    pol.reevaluate([], ctx(0.7))
    assert "r" not in pol._layer_pace


# -- the volume check ------------------------------------------------------------------------


# At B = 1e9 bytes/s a request's bytes take (bytes / 1e9) s; each row opens `opened` flows of r
# (size, links, layer index) at time 0 and says whether volume_check prunes r.
@pytest.mark.parametrize(
    ("opened", "deadline", "job_index", "args", "pruned"),
    [
        ([(int(1e8), (), 0)], 0.099, {}, {}, True),  # 0.1 s of bytes, 0.099 s left
        ([(int(1e8), (), 0)], 0.101, {}, {}, False),
        ([(int(6e7), (), 0), (int(6e7), (), 1)], 0.11, {}, {}, True),  # 0.12 s on one link
        ([(int(6e7), ("a",), 0), (int(6e7), ("b",), 1)], 0.11, {}, {}, False),  # two links
        ([(int(1e6), (), 0)], 0.031, {"j": 0}, {}, True),  # 32 layers of 1 ms to come
        ([(int(1e6), (), 0)], 0.033, {"j": 0}, {}, False),
        ([(int(1e6), (), 0)], 0.031, {}, {}, False),  # prefill over: no layer to come
        ([(int(1e8), (), 0)], 0.099, {}, {"volume_check": False}, False),
        ([(int(1e8), (), 0)], 0.099, {}, {"feasibility": False}, False),
        # reports up to 2 ms old: up to 2e6 bytes may have crossed since, so 0.098 s of them
        ([(int(1e8), (), 0)], 0.099, {}, {"volume_lag": 0.002}, False),
        ([(int(1e8), (), 0)], 0.097, {}, {"volume_lag": 0.002}, True),
    ],
    ids=[
        "too-many-bytes",
        "just-in-time",
        "open-flows-add-up",
        "other-links-do-not",
        "layers-to-come",
        "layers-to-come-in-time",
        "prefill-ended",
        "off",
        "no-feasibility",
        "lag-covers-it",
        "lag-too-short",
    ],
)
def test_volume_check_prunes_a_request_whose_bytes_cannot_cross_in_time(
    opened: list[tuple[int, tuple[str, ...], int]],
    deadline: float,
    job_index: dict[str, int],
    args: dict[str, Any],
    pruned: bool,
) -> None:
    args.setdefault("volume_check", True)
    pol = policy(pace_layers=0, **args)
    _learn_depth(pol, 32)
    levels = []
    for fid, (size, links, layer) in enumerate(opened, start=1):
        flow = build_flow(fid, cls="kv", size=size, deadline=deadline, request="r", job="j",
                          links=links, consumer_index=layer)  # fmt: skip
        levels.append(pol.admit(flow, ctx(job_index=job_index)).level)
    assert (levels[-1] == 7) is pruned


def test_volume_check_wakes_an_urgent_flow_when_its_bytes_run_out_of_time() -> None:
    # 0.15 s of bytes due at 0.2: urgent (MLU 0.75), level 1 until 25 ms before the deadline;
    # its bytes can no longer cross after 0.05 s, so the check asks to be woken there
    timers = {}
    for on in (False, True):
        pol = policy(volume_check=on, pace_layers=0)
        flow = build_flow(1, cls="kv", size=int(1.5e8), deadline=0.2, request="r")
        flow.level = pol.admit(flow, ctx()).level
        assert flow.level == 1
        timers[on] = pol.next_change(flow, ctx())
    assert timers[False] == pytest.approx(0.175)
    assert timers[True] == pytest.approx(0.05)
    decisions = pol.reevaluate([flow], ctx(0.051))  # nothing sent meanwhile
    assert {fid: d.level for fid, d in decisions.items()} == {1: 7}


def test_volume_lag_delays_the_check_by_the_bytes_the_link_may_have_carried_since() -> None:
    # as above, with byte counts up to 20 ms old: lost only from 0.07 on
    pol = policy(volume_check=True, volume_lag=0.02, pace_layers=0)
    flow = build_flow(1, cls="kv", size=int(1.5e8), deadline=0.2, request="r")
    flow.level = pol.admit(flow, ctx()).level
    assert pol.next_change(flow, ctx()) == pytest.approx(0.07)
    assert pol.reevaluate([flow], ctx()) == {}  # Algorithm 1 sees the arrival: feasible
    assert pol.reevaluate([flow], ctx(0.069)) == {}
    decisions = pol.reevaluate([flow], ctx(0.071))
    assert {fid: d.level for fid, d in decisions.items()} == {1: 7}


# -- promotion timers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("level", "now", "args", "expected"),
    [
        (6, 0.0, {"rho_source": "none"}, 0.2),  # MLU 0.125 at 0.8 s left
        (5, 0.0, {"rho_source": "none"}, 0.8),  # MLU 0.5 at 0.2 s left
        (1, 0.85, {}, 0.975),  # next urgent band: 25 ms left
        (2, 0.85, {"urgent_levels": 3}, 0.95),  # 50 ms left
        (0, 0.98, {}, 1.0),  # the deadline (pruning)
        (0, 0.98, {"feasibility": False}, None),
        (6, 0.0, {"rho_source": "none", "promotion_lead": 0.1}, 0.1),
    ],
    ids=["band2", "band1", "urgent-1", "urgent-2-of-3", "top-deadline", "top-nothing", "lead"],
)
def test_next_change(level: int, now: float, args: dict[str, Any], expected: float | None) -> None:
    pol = policy(**args)
    flow = build_flow(cls="kv", size=int(1e8), deadline=1.0)
    pol.admit(flow, ctx(now))
    flow.level = level
    found = pol.next_change(flow, ctx(now))
    assert found == (None if expected is None else pytest.approx(expected))


def test_next_change_assumes_rho_rises_as_fast_as_its_window_allows() -> None:
    # rho 0 now, window 50 ms, cap 0.9: (1 - d) x exp(-d / 0.05) reaches 0.8 s (MLU 0.125)
    # at d ~ 10.6 ms, long before the 200 ms it takes at rho 0
    pol = policy(rho_window=0.05)
    flow = build_flow(cls="kv", size=int(1e8), deadline=1.0, links=("a",))
    pol.admit(flow, ctx())
    flow.level = 6
    found = pol.next_change(flow, ctx())
    assert found is not None and 0.0100 < found < 0.0107
    assert (1 - found) * math.exp(-found / 0.05) >= 0.8  # not later than the crossing


@pytest.mark.parametrize(
    "flow",
    [
        build_flow(cls="tp"),
        build_flow(cls="experience", job="j", consumer_index=3),
        build_flow(cls="bulk"),
        build_flow(cls="param_sync", deadline=1.0),  # size unknown, not prunable
    ],
    ids=["tp", "experience", "bulk", "unknown-size-not-prunable"],
)
def test_next_change_none_without_a_time_driven_change(flow: Flow) -> None:
    pol = policy()
    flow.level = pol.admit(flow, ctx()).level
    assert pol.next_change(flow, ctx()) is None


@pytest.mark.parametrize(
    ("fields", "args", "now", "expected"),
    [
        ({}, {}, 0.0, 1.0),  # late at its deadline: pruned there
        ({"request": "r"}, {"mlu_scope": "request"}, 0.0, 1.0),
        ({}, {}, 1.0, None),  # already late: dropped, nothing left to wake
        ({}, {"feasibility": False}, 0.0, None),  # stays at unknown_level
        ({"deadline": None}, {}, 0.0, None),
        ({"cls": "param_sync"}, {"prune_classes": ["param_sync"]}, 0.0, 1.0),
    ],
    ids=["kv", "request-scope", "late", "no-pruning", "no-deadline", "pruned-param-sync"],
)
def test_a_flow_of_unknown_size_is_woken_at_its_deadline(
    fields: dict[str, Any], args: dict[str, Any], now: float, expected: float | None
) -> None:
    """An explicit flow opened without a size (an SDK kv flow) has no MLU and sits at
    ``unknown_level``; past its deadline it is late like a sized one with bytes left, and
    its timer must wake it there: next_change said None, so nothing moved it to the
    scavenger level under promotion timers (nothing else reports on such a flow)."""
    pol = policy(**args)
    fields = {"cls": "kv", "deadline": 1.0, **fields}
    flow = build_flow(**fields)
    flow.level = pol.admit(flow, ctx()).level
    assert flow.level == pol.unknown_level
    assert pol.next_change(flow, ctx(now)) == expected
    if expected is not None:
        assert pol.reevaluate([flow], ctx(expected - 1e-6)) == {}
        assert pol.reevaluate([flow], ctx(expected))[1].level == pol.scavenger


@pytest.mark.parametrize(
    ("now", "args", "expected"),
    [
        (0.5, {}, 1.0),  # the deadline (pruning), not the next urgent band
        (0.99, {}, 1.0),  # inside that band's time already
        (0.5, {"feasibility": False}, None),
        (0.99, {"feasibility": False}, None),
        (1.5, {"feasibility": False}, None),  # late, not prunable
        (0.99, {"urgent_order": "slack", "feasibility": False}, None),
    ],
    ids=["prunable", "prunable-in-band", "far", "in-band", "late", "slack"],
)
def test_next_change_of_a_flow_held_at_an_urgent_level(
    now: float, args: dict[str, Any], expected: float | None
) -> None:
    """An urgent P2D flow whose job then reports prefill is held below the collectives but
    never demoted: it keeps its urgent level, and time alone cannot move it within the urgent
    tier. next_change said 1 us from now for ever once its time left reached the next band
    (a re-evaluation every coordinator tick, 50,000 simulator events per 0.05 s)."""
    pol = policy(**args)
    flow = build_flow(cls="kv", size=int(6e8), deadline=1.0, job="j", consumer_index=2)
    flow.level = pol.admit(flow, ctx(0.0)).level
    assert flow.level == 1
    flow.sent = int(6e8) - 10**6  # feasible: Algorithm 1 leaves it alone
    held = ctx(now, job_index={"j": 3})
    assert pol.reevaluate([flow], held) == {}
    found = pol.next_change(flow, held)
    assert found == (None if expected is None else pytest.approx(expected))


def assert_level_moves_at_next_change(pol: rmlq.RmlqPolicy, size: int, deadline: float) -> None:
    """A kv flow's level holds until ``next_change`` and moves up right after, each time."""
    flow = build_flow(cls="kv", size=size, deadline=deadline)
    now = 0.0
    flow.level = pol.admit(flow, ctx(now)).level
    while (when := pol.next_change(flow, ctx(now))) is not None:
        assert when >= now
        before = max(now, when - 1e-6 * max(deadline, 1.0))
        assert pol.reevaluate([flow], ctx(before)) == {}
        after = when + 1e-6 * max(deadline, 1.0)
        moved = pol.reevaluate([flow], ctx(after))
        assert moved and moved[flow.flow_id].level < flow.level
        flow.level, now = moved[flow.flow_id].level, after


@settings(max_examples=90, deadline=None)
@given(
    size=st.integers(1, 10**10),
    deadline=st.floats(0.01, 10.0),
    urgent_levels=st.integers(1, 3),
    top_threshold=st.floats(0.01, 1.0),
)
def test_next_change_is_when_the_level_changes(
    size: int, deadline: float, urgent_levels: int, top_threshold: float
) -> None:
    """With no reports in between, the level holds until next_change and moves right after,
    the urgent tier's threshold anywhere in (0, 1] (below the MLU bands' included)."""
    pol = policy(
        rho_source="none",
        feasibility=False,
        urgent_levels=urgent_levels,
        top_threshold=top_threshold,
    )
    assert_level_moves_at_next_change(pol, size, deadline)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10**10), min_size=1, max_size=6),
    deadline=st.floats(0.01, 10.0),
    now=st.floats(0.0, 12.0),
    move=st.booleans(),
)
def test_next_change_after_reevaluate_is_what_it_computes_afresh(
    sizes: list[int], deadline: float, now: float, move: bool
) -> None:
    """next_change reuses the urgency reevaluate computed a moment before for the same flow
    (same instant, level and bytes); with the level changed in between (the caller applied
    a decision) or bytes reported, it computes it again. Either way its answer is the one
    a fresh computation gives."""
    pol = policy()
    link = ("n0/eth0",)
    flows = [build_flow(i, "kv", size=size, deadline=deadline, links=link) for i, size in
             enumerate(sizes)]  # fmt: skip
    for flow in flows:
        flow.level = pol.admit(flow, ctx(0.0)).level
    for flow in flows[::2]:  # some bytes on the link, under the flows' levels
        flow.sent = flow.size // 3 if flow.size else 0
    changed = pol.reevaluate(flows, ctx(now))
    for flow in flows:
        if flow.flow_id in changed:
            flow.level = changed[flow.flow_id].level
        elif move and flow.level > 0:
            flow.level -= 1
    reused = [pol.next_change(flow, ctx(now)) for flow in flows]
    assert not pol._found, "next_change leaves nothing behind for the flows it was asked for"
    assert reused == [pol.next_change(flow, ctx(now)) for flow in flows]


# -- construction and validation ------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_levels", "args", "message"),
    [
        (6, {}, "policy.args.early_levels: 3 early levels leave no MLU band with K=6"),
        (8, {"unknown_level": 8}, "unknown_level"),
        (8, {"urgent_levels": 5}, "need K >= urgent_levels"),
    ],
    ids=["too-few-levels", "unknown-level-out-of-range", "too-many-urgent-levels"],
)
def test_bad_construction(num_levels: int, args: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        policy(num_levels, **args)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"E": 1.0}, "policy.args.E: expected a number in (1.0, 1024.0]"),
        ({"U": "x"}, "policy.args.U"),
        ({"rho_source": "ewma"}, "policy.args.rho_source"),
        ({"feasibility": 1}, "policy.args.feasibility: expected true or false"),
        ({"bogus": 1}, "policy.args.bogus: unknown key"),
        ({"rho_window": 0}, "policy.args.rho_window"),
        ({"prune_classes": ["tp"]}, "policy.args.prune_classes[0]"),
        ({"request_memory": -1}, "policy.args.request_memory"),
        ({"promotion_lead": -0.1}, "policy.args.promotion_lead"),
        ({"feasibility_load": "others"}, "policy.args.feasibility_load"),
        ({"feasibility_check": "always"}, "policy.args.feasibility_check"),
        ({"drop_budget": -1}, "policy.args.drop_budget"),
        ({"alg1_interval": -1}, "policy.args.alg1_interval"),
        ({"pace_layers": -1}, "policy.args.pace_layers"),
        ({"volume_check": "yes"}, "policy.args.volume_check"),
        ({"volume_lag": -0.1}, "policy.args.volume_lag: expected a number >= 0.0"),
        ({"urgent_levels": 0}, "policy.args.urgent_levels"),
        ({"urgent_ratio": 1.0}, "policy.args.urgent_ratio"),
        ({"urgent_ratio": 1e200}, "policy.args.urgent_ratio: expected a number in (1.0, 1024.0]"),
        ({"urgent_order": "size"}, "policy.args.urgent_order"),
    ],
    ids=[
        "E",
        "U-type",
        "rho-source",
        "feasibility-type",
        "unknown",
        "rho-window-zero",
        "prune-implicit-class",
        "request-memory",
        "promotion-lead-negative",
        "feasibility-load",
        "feasibility-check",
        "drop-budget",
        "alg1-interval",
        "pace-layers",
        "volume-check-type",
        "volume-lag-negative",
        "urgent-levels",
        "urgent-ratio",
        "urgent-ratio-huge",
        "urgent-order",
    ],
)
def test_validate_names_field(args: dict[str, Any], fragment: str) -> None:
    errors = rmlq.validate(args, "policy.args")
    assert any(fragment in e for e in errors), errors


@pytest.mark.parametrize(
    ("num_levels", "args", "first", "last"),
    [
        (8, {}, "urgent: MLU >= 0.5 or late, time left <= 0.025 s", "scavenger: bulk, pruned"),
        (12, {"early_levels": 5, "red_tiers": 2}, "urgent:", "scavenger"),
        (8, {"feasibility": False, "urgent_order": "slack"}, "urgent: MLU >= 0.5 or late, slack",
         "scavenger: bulk"),
    ],
    ids=["default", "K12", "slack"],
)  # fmt: skip
def test_describe_levels_covers_every_level(
    num_levels: int, args: dict[str, Any], first: str, last: str
) -> None:
    lines = policy(num_levels, **args).describe_levels()
    assert len(lines) == num_levels
    assert lines[0].startswith(first) and lines[-1].startswith(last)


# -- property: never demote over random event sequences ------------------------------------

CLASSES = list(FlowClass)

flow_specs = st.lists(
    st.tuples(
        st.sampled_from(CLASSES),
        st.one_of(st.none(), st.integers(0, 10**10)),  # size
        st.one_of(st.none(), st.floats(0.0, 5.0)),  # deadline
        st.one_of(st.none(), st.integers(0, 12)),  # consumer index
        st.sampled_from([None, "r1", "r2", "r3"]),  # request
    ),
    min_size=1,
    max_size=12,
)
events = st.lists(
    st.tuples(
        st.floats(0.0, 0.5),  # time step
        st.integers(-3, 3),  # job index change
        st.floats(0.0, 1.0),  # link load
        st.integers(0, 10**9),  # bytes sent by every flow
    ),
    max_size=15,
)


@settings(max_examples=60, deadline=None)
@given(
    specs=flow_specs,
    steps=events,
    feasibility=st.booleans(),
    collectives_first=st.booleans(),
    red_tiers=st.integers(1, 3),
    num_levels=st.integers(7, 12),
)
def test_rmlq_never_demotes(
    specs: list[tuple[Any, ...]],
    steps: list[tuple[float, int, float, int]],
    feasibility: bool,
    collectives_first: bool,
    red_tiers: int,
    num_levels: int,
) -> None:
    pol = policy(
        num_levels,
        feasibility=feasibility,
        collectives_first=collectives_first,
        red_tiers=red_tiers,
        feasibility_grace=0.1,
    )
    flows = [
        build_flow(
            i, cls=c, size=s, deadline=d, job="j", consumer_index=ci, request=r, links=("l",)
        )
        for i, (c, s, d, ci, r) in enumerate(specs)
    ]
    now, index = 0.0, 0
    for flow in flows:
        flow.level = pol.admit(flow, ctx(now, job_index={"j": index})).level
        assert 0 <= flow.level < num_levels
    for dt, didx, load, sent in steps:
        now, index = now + dt, max(index + didx, 0)
        for flow in flows:
            flow.sent = (
                min(flow.sent + sent, flow.size) if flow.size is not None else flow.sent + sent
            )
        context = ctx(now, job_index={"j": index}, link_load={"l": load})
        for fid, decision in pol.reevaluate(flows, context).items():
            flow = flows[fid]
            assert 0 <= decision.level < num_levels
            if decision.level > flow.level:  # only the documented scavenger move
                assert feasibility and pol.dropped(flow, now) and decision.level == num_levels - 1
            flow.level = decision.level


def test_zero_bandwidth_link_means_infinite_mlu() -> None:
    assert rmlq.mlu(1e6, 1.0, 0.0, 0.0) == float("inf")
    flow = build_flow(cls="kv", size=10, deadline=5.0, links=("dead",))
    assert policy().admit(flow, ctx(link_bandwidth={"dead": 0.0})).level == 1  # urgent, 5 s left


# -- request-scope MLU and deferred deadline order -------------------------------------------


def _request_flows(pol: rmlq.RmlqPolicy, job_index: dict[str, int]) -> list[Flow]:
    """Request r's layers 0 and 1 (1e7 bytes each, due at 1.0) on path p, and r's layer 0 to
    another decode path q; the model is 4 layers deep (learned from an older request)."""
    old = build_flow(9, cls="kv", size=10, deadline=5.0, request="old", consumer_index=3)
    pol.admit(old, ctx())
    pol.release(old, ctx())
    flows = [
        build_flow(1, cls="kv", size=int(1e7), deadline=1.0, job="j", request="r",
                   consumer_index=0, links=("p",)),
        build_flow(2, cls="kv", size=int(1e7), deadline=1.0, job="j", request="r",
                   consumer_index=1, links=("p",)),
        build_flow(3, cls="kv", size=int(1e7), deadline=1.0, job="j", request="r",
                   consumer_index=0, links=("q",)),
    ]  # fmt: skip
    for flow in flows:
        flow.level = pol.admit(flow, ctx(job_index=job_index)).level
    return flows


@pytest.mark.parametrize(
    ("scope", "job_index", "sent", "remaining"),
    [
        ("request", {"j": 1}, 0, 4e7),  # 2 open on p + layers 2 and 3 not opened yet
        ("request", {}, 0, 2e7),  # prefill over: no more layers come
        ("request", {"j": 1}, int(5e6), 3.5e7),  # layer 0 half sent
        ("flow", {"j": 1}, 0, 1e7),
    ],
    ids=["in-prefill", "prefill-done", "partly-sent", "flow-scope"],
)
def test_mlu_counts_the_request_bytes_on_the_path(
    scope: str, job_index: dict[str, int], sent: int, remaining: float
) -> None:
    pol = policy(mlu_scope=scope, rho_source="none")
    first, second, _other_path = _request_flows(pol, job_index)
    first.sent = sent
    found = pol.urgency(second, ctx(job_index=job_index, link_bandwidth={"p": B, "q": B}))
    assert found is not None and found.remaining == remaining
    assert found.value == pytest.approx(remaining / B)  # 1 s left on 1e9 B/s


def test_request_scope_forgets_closed_layers() -> None:
    pol = policy(rho_source="none")
    first, second, _ = _request_flows(pol, {})
    pol.release(first, ctx())
    found = pol.urgency(second, ctx(link_bandwidth={"p": B, "q": B}))
    assert found is not None and found.remaining == 1e7


def _scanned_linked(opened: dict[int, Flow], flow: Flow) -> tuple[int, ...]:
    """``linked_flows`` as it was (a scan of the request's every open flow), the reference."""
    return tuple(
        fid
        for fid, other in opened.items()
        if fid != flow.flow_id and other.request == flow.request and other.links == flow.links
    )


def _scanned_request_remaining(
    pol: rmlq.RmlqPolicy, opened: dict[int, Flow], flow: Flow, context: Context
) -> int:
    """The request's bytes on ``flow``'s path as they were computed (the same scan)."""
    remaining, last = flow.remaining or 0, flow.consumer_index
    for other in opened.values():
        if other.request != flow.request or other.flow_id == flow.flow_id:
            continue
        if other.links == flow.links:
            remaining += other.remaining or 0
        index = other.consumer_index
        if index is not None and (last is None or index > last):
            last = index
    return remaining + pol._unopened_layers(flow, last, context) * (flow.size or 0)


#: one step of a request-scope run: open (request, path, layer or None), close the i-th open
#: flow, or send bytes on it
_REQUEST_STEPS = st.one_of(
    st.tuples(
        st.just("open"),
        st.sampled_from(["r1", "r2"]),
        st.sampled_from([("a",), ("b",), ("a", "b")]),
        st.none() | st.integers(0, 6),
    ),
    st.tuples(st.just("close"), st.integers(0, 40)),
    st.tuples(st.just("send"), st.integers(0, 40), st.integers(0, 10**6)),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(_REQUEST_STEPS, max_size=60), in_prefill=st.booleans())
def test_request_index_answers_as_the_scan_of_every_open_flow(
    steps: list[tuple[Any, ...]], in_prefill: bool
) -> None:
    """With ``mlu_scope = "request"`` a request's flows are indexed by path (its opens were
    O(n^2): ``linked_flows`` and the request's bytes scanned all its open flows per open).
    After every open, close and progress, the index gives what the scan gave: the same
    linked flows in the same order, the same request bytes (so the same MLU and levels)."""
    pol = policy(mlu_scope="request", rho_source="none")
    context = ctx(job_index={"j": 0} if in_prefill else {})
    opened: dict[int, Flow] = {}
    for number, step in enumerate(steps, start=1):
        ids = list(opened)
        if step[0] == "open":
            _, request, links, index = step
            flow = build_flow(number, cls="kv", size=10**6, deadline=5.0, job="j",
                              request=request, links=links, consumer_index=index)  # fmt: skip
            flow.level = pol.admit(flow, context).level
            assert pol.linked_flows(flow) == _scanned_linked(opened, flow)
            opened[flow.flow_id] = flow
        elif ids and step[0] == "close":
            pol.release(opened.pop(ids[step[1] % len(ids)]), context)
        elif ids:
            target = opened[ids[step[1] % len(ids)]]
            target.sent = min(target.sent + step[2], target.size or 0)
        for flow in opened.values():
            assert pol.linked_flows(flow) == _scanned_linked(opened, flow)
            found = pol.urgency(flow, context)
            assert found is not None
            assert found.remaining == _scanned_request_remaining(pol, opened, flow, context)
    for flow in opened.values():
        pol.release(flow, context)
    assert not pol._siblings


def _kept(flows: rmlq._RequestFlows) -> dict[tuple[str, ...], list[int]]:
    return {path: list(group) for path, group in flows.by_path.items()}


def _kv(flow_id: int, links: tuple[str, ...], index: int | None) -> Flow:
    return build_flow(flow_id, cls="kv", size=1, deadline=1.0, request="r", links=links,
                      consumer_index=index)  # fmt: skip


@pytest.mark.parametrize(
    ("steps", "kept", "deepest"),
    [
        ([("add", 1, ("a",), 3), ("add", 2, ("a",), 5)], {("a",): [1, 2]}, 5),
        # a re-admitted flow keeps its place on its path, and its index is replaced
        ([("add", 1, ("a",), 3), ("add", 2, ("a",), 5), ("add", 1, ("a",), 7)],
         {("a",): [1, 2]}, 7),
        ([("add", 1, ("a",), 7), ("add", 2, ("a",), 5), ("add", 1, ("a",), 3)],
         {("a",): [1, 2]}, 5),
        # re-admitted on another path: moved, counted once
        ([("add", 1, ("a",), 3), ("add", 2, ("a",), 5), ("add", 1, ("b",), 3)],
         {("a",): [2], ("b",): [1]}, 5),
        ([("add", 1, ("a",), 3), ("add", 2, ("b",), 5), ("remove", 2, ("b",), 5)],
         {("a",): [1]}, 3),
        # an index back after all its flows closed; an unknown flow's removal changes nothing
        ([("add", 1, ("a",), 5), ("remove", 1, ("a",), 5), ("add", 2, ("a",), 5),
          ("remove", 9, ("a",), 1)], {("a",): [2]}, 5),
        ([("add", 1, ("a",), None), ("add", 2, ("a",), 4), ("remove", 2, ("a",), 4)],
         {("a",): [1]}, None),
    ],
    ids=["two", "readmit-deeper", "readmit-shallower", "readmit-moved", "remove-path",
         "index-again", "no-index"],
)  # fmt: skip
def test_request_flows_index(
    steps: list[tuple[str, int, tuple[str, ...], int | None]],
    kept: dict[tuple[str, ...], list[int]],
    deepest: int | None,
) -> None:
    flows = rmlq._RequestFlows()
    for what, flow_id, links, index in steps:
        if what == "add":
            flows.add(_kv(flow_id, links, index))
        else:
            flows.remove(_kv(flow_id, links, index))
    assert _kept(flows) == kept
    assert flows.deepest() == deepest
    assert sorted(flows.path_of) == sorted(fid for ids in kept.values() for fid in ids)


# deferred bands in deadline order (K=8: 5 = time left <= 25 ms, 6 = more), MLU < 0.5
@pytest.mark.parametrize(
    ("size", "deadline", "args", "level"),
    [
        (1e6, 0.02, {}, 5),
        (1e6, 0.025, {}, 5),
        (1e6, 0.03, {}, 6),
        (1e6, 1.0, {}, 6),
        (1e7, 0.015, {}, 0),  # MLU 0.67: urgent, 15 ms left
        (1e6, 0.04, {"deferred_slack": 0.05}, 5),
        (1e6, 0.08, {"early_levels": 2, "deferred_slack": 0.05}, 5),  # bands 4/5/6: <= 100 ms
        (1e6, 0.04, {"early_levels": 2, "deferred_slack": 0.05}, 4),
        (1e6, 0.2, {"early_levels": 2, "deferred_slack": 0.05}, 6),
    ],
    ids=["20ms", "25ms-inclusive", "30ms", "1s", "urgent", "slack-50ms", "three-bands-mid",
         "three-bands-top", "three-bands-rest"],
)  # fmt: skip
def test_deferred_bands_in_deadline_order(
    size: float, deadline: float, args: dict[str, Any], level: int
) -> None:
    pol = policy(**{"deferred_order": "deadline", "deferred_slack": 0.025, "rho_source": "none",
                    **args})  # fmt: skip
    flow = build_flow(cls="kv", size=int(size), deadline=deadline)
    assert pol.admit(flow, ctx()).level == level


@settings(max_examples=80, deadline=None)
@given(
    flows=st.lists(st.tuples(st.integers(1, 10**9), st.floats(0.001, 5.0)), min_size=2, max_size=8),
    now=st.floats(0.0, 0.5),
    early_levels=st.integers(1, 3),
    urgent_levels=st.integers(1, 3),
    slack=st.floats(0.001, 0.5),
)
def test_earlier_deadline_never_sits_below_a_later_one_in_its_tier(
    flows: list[tuple[int, float]],
    now: float,
    early_levels: int,
    urgent_levels: int,
    slack: float,
) -> None:
    """Deadline order holds inside the urgent tier and inside the deferred bands: of two
    explicit flows in the same tier, the one due first is never at a less urgent level."""
    pol = policy(
        deferred_order="deadline",
        deferred_slack=slack,
        early_levels=early_levels,
        urgent_levels=urgent_levels,
        rho_source="none",
        feasibility=False,
        mlu_scope="flow",
    )
    placed = []
    for i, (size, deadline) in enumerate(flows):
        flow = build_flow(i, cls="kv", size=size, deadline=now + deadline)
        level = pol.admit(flow, ctx(now)).level
        placed.append((deadline, level < pol.first_early, level))
    for d1, urgent1, l1 in placed:
        for d2, urgent2, l2 in placed:
            if urgent1 == urgent2 and d1 <= d2:
                assert l1 <= l2


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 10**10),
    deadline=st.floats(0.01, 10.0),
    slack=st.floats(0.005, 1.0),
    early_levels=st.integers(1, 3),
)
def test_next_change_is_when_a_deferred_deadline_band_changes(
    size: int, deadline: float, slack: float, early_levels: int
) -> None:
    """Deferred bands in deadline order: the level holds until next_change, moves right after."""
    pol = policy(
        rho_source="none",
        feasibility=False,
        deferred_order="deadline",
        deferred_slack=slack,
        early_levels=early_levels,
    )
    assert_level_moves_at_next_change(pol, size, deadline)


def test_default_bands_deferred_flows_by_deadline() -> None:
    made = create("rmlq", {"rho_source": "none"}, num_levels=8)
    near = build_flow(1, cls="kv", size=int(1e6), deadline=0.02)  # MLU 0.05, 20 ms left
    far = build_flow(2, cls="kv", size=int(1e8), deadline=0.5)  # MLU 0.2, 500 ms left
    assert [made.admit(f, ctx()).level for f in (near, far)] == [5, 6]


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"urgent_order": "slack"},
        {"feasibility": True, "feasibility_check": "alg1"},
        {"feasibility": False},
    ],
    ids=["default", "slack-order", "alg1", "no-feasibility"],
)
def test_levels_observe_progress_skips_are_ones_where_bytes_never_move_a_flow(
    args: dict[str, Any],
) -> None:
    """observe_progress skips flows at ``_inert_levels`` without asking
    ``_moved_by_progress``: at each of them, no explicit flow (held below its job's
    collectives, tracked, with bytes left or none) is ever moved by bytes."""
    pol = policy(**args)
    now = ctx(1.0, job_index={"j": 0})
    assert pol._inert_levels, "nothing skipped"
    assert pol.scavenger not in pol._inert_levels
    for level in range(pol.num_levels):
        for cls in ("kv", "param_sync"):
            for sent in (0, 1000):
                flow = build_flow(7, cls, size=1000, sent=sent, deadline=2.0, job="j")
                pol.admit(flow, now)
                flow.level = level
                if level in pol._inert_levels:
                    assert not pol._moved_by_progress(flow, now), (level, cls, sent)
                pol.release(flow, now)


# -- the model depth is learned per scope (audit H4) -----------------------------------------


def _open_layers(pol: rmlq.RmlqPolicy, request: str, deadline: float) -> list[int]:
    levels = []
    for layer, now in enumerate(_STEADY):
        flow = build_flow(layer + 1, cls="kv", size=int(1e6), deadline=deadline, request=request,
                          consumer_index=layer, opened_at=now)  # fmt: skip
        levels.append(pol.admit(flow, ctx(now)).level)
    return levels


@pytest.mark.parametrize("index", [2**20 - 1, 2**63 - 1])
def test_one_users_absurd_layer_index_does_not_prune_another_users_requests(index: int) -> None:
    # a 32-layer model: at its 10 ms pace, request 1000/r's last layer is across just in time
    pol = policy()
    for layers, request in ((32, "1000/old"), (1, "666/x")):
        deepest = build_flow(90 + layers, cls="kv", size=10, deadline=9.0, request=request,
                             consumer_index=layers - 1 if layers > 1 else index)  # fmt: skip
        pol.admit(deepest, ctx())
        pol.release(deepest, ctx())
    assert 7 not in _open_layers(pol, "1000/r", 0.3115)
    # the other user's own requests are judged by its own (absurd) depth when it is a layer
    assert (7 in _open_layers(pol, "666/y", 0.3115)) == (index < rmlq.MAX_DEPTH)


def test_an_index_that_is_no_layer_never_deepens_the_model() -> None:
    pol = policy()
    _learn_depth(pol, 32)
    _learn_depth(pol, rmlq.MAX_DEPTH + 1)
    assert 7 not in _open_layers(pol, "r", 0.3115)  # still the 32-layer model: just in time


@pytest.mark.parametrize(
    ("urgent_levels", "deferred_order"),
    [(61, "deadline"), (1, "deadline"), (61, "mlu")],
    ids=["urgent-bands", "deferred-bands", "urgent-bands-mlu"],
)
def test_the_largest_urgent_ratio_overflows_nothing(
    urgent_levels: int, deferred_order: str
) -> None:
    """urgent_ratio is bounded (validate) so that ratio^i, up to K = 64 levels, stays a float:
    describe_levels and next_change at every level work (1e200 raised OverflowError)."""
    ratio = rmlq.MAX_BAND_RATIO
    assert rmlq.validate({"urgent_ratio": ratio}, "policy.args") == []
    pol = policy(64, urgent_levels=urgent_levels, early_levels=1, urgent_ratio=ratio,
                 deferred_order=deferred_order)  # fmt: skip
    assert len(pol.describe_levels()) == 64
    flow = build_flow(cls="kv", size=int(1e8), deadline=1e6)
    pol.admit(flow, ctx())
    for level in range(63):
        flow.level = level
        found = pol.next_change(flow, ctx())
        assert found is None or found > 0


# -- bounded state, clock steps --------------------------------------------------------------


def _run_batches(pol: rmlq.RmlqPolicy, batches: int) -> int:
    """Serve ``batches`` batches of one request x 3 layers (each layer's P2D opened as the job
    reaches it, urgent), close them all and return the most jobs ``pol`` remembered at once."""
    now, fid, most = 0.0, 0, 0
    for batch in range(batches):
        job = f"i0/b{batch}"
        flows = []
        for layer in range(3):
            fid += 1
            flow = build_flow(fid, cls="kv", size=int(1.5e8), deadline=now + 0.1, job=job,
                              consumer_index=layer, request=f"{job}/r", links=("n0",))  # fmt: skip
            flow.level = pol.admit(flow, ctx(now, job_index={job: layer})).level
            flows.append(flow)
            now += 0.011
            for changed, decision in pol.reevaluate(
                flows, ctx(now, job_index={job: layer + 1})
            ).items():
                next(f for f in flows if f.flow_id == changed).level = decision.level
            most = max(most, len(pol._job_seen), len(pol._job_pace))
        now += 0.011
        for flow in flows:  # the job's prefill is over: it left job_index
            flow.sent = flow.size or 0
            pol.release(flow, ctx(now))
    pol.reevaluate([], ctx(now + 0.011))  # the last request left: Algorithm 1 runs
    return most


def test_job_state_is_forgotten_once_the_job_is_gone() -> None:
    """The per-job pace (Algorithm 1's remaining compute) is kept for the jobs in
    ``Context.job_index`` only: a serving job is one batch, and an entry per batch kept for
    good grew the coordinator's policy for as long as it ran."""
    pol = policy()
    most = _run_batches(pol, 30)
    assert 1 <= most <= 2, "the pace of the job in prefill is followed"
    assert pol._job_seen == {} and pol._job_pace == {}


def _alg1_after_a_clock_step(step_back: float) -> list[str]:
    """Three requests of 4e7 bytes due 60 ms after a clock step of ``step_back`` seconds
    back, on one 1e9 B/s link: one fits; what Algorithm 1 prunes."""
    pol = policy(pace_layers=0)
    t0 = 1000.0
    warm = build_flow(1, cls="kv", size=10**6, deadline=t0 + 1, request="w", links=("n0",))
    warm.level = pol.admit(warm, ctx(t0)).level
    pol.reevaluate([warm], ctx(t0 + 0.02))  # Algorithm 1 ran at t0 + 0.02
    now = t0 + 0.03 - step_back
    flows = [build_flow(10 + i, cls="kv", size=int(4e7), deadline=now + 0.06, request=f"r{i}",
                        links=("n0",)) for i in range(3)]  # fmt: skip
    for flow in flows:
        flow.level = pol.admit(flow, ctx(now)).level
    for k in range(1, 4):
        for changed, decision in pol.reevaluate(flows, ctx(now + 0.011 * k)).items():
            next(f for f in flows if f.flow_id == changed).level = decision.level
    return sorted(pol._pruned)


@pytest.mark.parametrize("step_back", [0.005, 1.0, 60.0], ids=["5ms", "1s", "60s"])
def test_algorithm_1_runs_on_after_the_clock_steps_back(step_back: float) -> None:
    """A wall clock stepped back (NTP) re-bases the policy's times: Algorithm 1 keeps its
    interval instead of waiting for the clock to pass its last run again."""
    pruned = _alg1_after_a_clock_step(0.0)
    assert len(pruned) == 1
    assert _alg1_after_a_clock_step(step_back) == pruned


def test_idle_request_state_is_forgotten_after_the_clock_steps_back() -> None:
    pol = policy(request_memory=0.5)
    flow = build_flow(1, cls="kv", size=10, deadline=2000.0, request="r", consumer_index=0)
    pol.admit(flow, ctx(1000.0))
    pol.release(flow, ctx(1000.1))
    pol.reevaluate([], ctx(940.3))  # the clock stepped back: counted as no time passed
    pol.reevaluate([], ctx(940.7))
    assert "r" in pol._layer_pace  # 0.4 s since the step
    pol.reevaluate([], ctx(940.85))
    assert "r" not in pol._layer_pace


@pytest.mark.parametrize("step_back", [1.0, 60.0], ids=["1s", "60s"])
def test_traffic_meter_measures_on_after_the_clock_steps_back(step_back: float) -> None:
    """rho does not freeze at its value before a backward clock step: the meter re-bases its
    times and keeps counting (it skipped every update until the clock passed them again)."""
    meter = TrafficMeter(0.05)
    flow = build_flow(1, cls="kv", size=10**12, links=("n0",))
    flow.level = 3
    meter.open(flow, 1000.0)
    meter.update([flow], ctx(1000.0))  # idle so far
    now = 1000.0 - step_back
    for k in range(1, 41):  # then 200 ms at the link's full rate
        flow.sent += 5 * 10**6
        meter.update([flow], ctx(now + 0.005 * k))
    assert meter.link_load("n0") == pytest.approx(1.0, rel=0.05)
    assert meter.flow_rate(flow) == pytest.approx(B, rel=0.05)


def test_next_change_never_returns_a_past_deadline() -> None:
    """With ``mlu_scope = "request"`` a flow whose own bytes are all sent still has its
    request's bytes left; its deadline, once past, was returned at every call (the
    coordinator re-fired its timer on every tick)."""
    pol = policy(mlu_scope="request", drop_budget=0)
    done = build_flow(1, cls="kv", size=10**6, deadline=0.01, request="r", links=("L",))
    busy = build_flow(2, cls="kv", size=10**9, deadline=0.01, request="r", links=("L",))
    for flow in (done, busy):
        flow.level = pol.admit(flow, ctx()).level
    done.sent = done.size or 0
    for now in (0.005, 0.01, 0.011, 0.05):
        found = pol.next_change(done, ctx(now))
        assert found is None or found > now, (now, found)
    assert pol.next_change(busy, ctx(0.005)) == pytest.approx(0.01)  # its own deadline: pruned


@pytest.mark.parametrize(
    ("cls", "consumer", "job_index", "rli"),
    [
        (FlowClass.KV_REUSE, 20, {"job-7": 41, "job-7/layer": 12}, 8),  # the reported layer
        (FlowClass.KV, 20, {"job-7": 41, "job-7/layer": 12}, 8),
        (FlowClass.KV_REUSE, 20, {"job-7": 12}, 8),  # no layer: the step is the layer
        (FlowClass.EXPERIENCE, 43, {"job-7": 41, "job-7/layer": 12}, 2),  # a step, not a layer
        (FlowClass.KV_REUSE, 20, {}, None),  # job unknown
    ],
)
def test_layer_indexed_flows_count_rli_from_the_jobs_layer(
    cls: FlowClass, consumer: int, job_index: dict[str, int], rli: int | None
) -> None:
    """``job_progress(job, step, layer)``: a kv_reuse flow's consumer is a layer, compared
    with the job's reported layer (it was compared with the step: RLI 0 for layer 20 at step
    41, layer 12)."""
    policy = rmlq.RmlqPolicy(rmlq.Args(), num_levels=8)
    flow = Flow(1, cls, 0.0, size=10**6, job="job-7", consumer_index=consumer)
    assert policy.flow_rli(flow, ctx(job_index=job_index)) == rli
