"""rmlq: hand-computed MLU bands, RLI levels, RED, feasibility, rho sources, never-demote."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_flows import build_flow

from flowsched.model import Context, Flow, FlowClass
from flowsched.policies import create, rmlq
from flowsched.policies.common import TrafficMeter

B = 1e9  # bytes/s of the default link in these tests


def ctx(now: float = 0.0, **fields: Any) -> Context:
    fields.setdefault("default_bandwidth", B)
    return Context(now=now, **fields)


def policy(num_levels: int = 8, **args: Any) -> rmlq.RmlqPolicy:
    made = create("rmlq", args, num_levels=num_levels)
    assert isinstance(made, rmlq.RmlqPolicy)
    return made


# Defaults K=8, R=3, E=4, U=0.5: 0 = MLU>=0.5; 1..3 = RLI 0,1,2+; 4 = [0.125,0.5);
# 5 = [0.03125,0.125); 6 = below; 7 = scavenger. MLU = remaining / (1 s x 1e9 B/s).
@pytest.mark.parametrize(
    ("remaining", "deadline", "level"),
    [
        (6e8, 1.0, 0),
        (5e8, 1.0, 0),
        (4.99e8, 1.0, 4),
        (2e8, 1.0, 4),
        (1.25e8, 1.0, 4),
        (1e8, 1.0, 5),
        (3.125e7, 1.0, 5),
        (3e7, 1.0, 6),
        (1e3, 1.0, 6),
        (0, 1.0, 6),
        (1e3, -0.5, 0),
        (1e8, 0.2, 0),
    ],
    ids=[
        "mlu-0.6-top",
        "mlu-0.5-top-inclusive",
        "mlu-0.499-band1",
        "mlu-0.2-band1",
        "mlu-0.125-band1-inclusive",
        "mlu-0.1-band2",
        "mlu-Q2-band2-inclusive",
        "mlu-0.03-lowest",
        "tiny-lowest",
        "finished-lowest",
        "past-deadline-top",
        "mlu-0.5-in-0.2s-top",
    ],
)
def test_explicit_flow_level_from_mlu(remaining: float, deadline: float, level: int) -> None:
    flow = build_flow(cls="kv", size=int(remaining), deadline=deadline)
    assert policy().admit(flow, ctx()).level == level


@pytest.mark.parametrize(
    ("value", "level"),
    [(1.0, 0), (0.5, 0), (0.3, 4), (0.1, 5), (0.01, 6)],
    ids=["1", "U", "0.3", "0.1", "0.01"],
)
def test_mlu_level_table(value: float, level: int) -> None:
    assert policy().mlu_level(value) == level


def test_top_threshold_and_band_parameters() -> None:
    # top at 1.0, E=2, U=1 -> bands [0.5, 1), [0.25, 0.5), below
    custom = policy(E=2.0, U=1.0, top_threshold=1.0)
    assert [custom.mlu_level(v) for v in (1.0, 0.7, 0.3, 0.2)] == [0, 4, 5, 6]


def test_mlu_formula() -> None:
    assert rmlq.mlu(1e9, 2.0, 1e9, 0.5) == pytest.approx(1.0)
    assert rmlq.mlu(0, 1.0, 1e9, 0.0) == 0.0
    assert rmlq.mlu(1, 0.0, 1e9, 0.0) == float("inf")


@pytest.mark.parametrize(
    ("cls", "consumer", "current", "level"),
    [
        ("tp", None, None, 1),
        ("experience", 5, 5, 1),
        ("experience", 6, 5, 2),
        ("experience", 7, 5, 3),
        ("experience", 8, 5, 3),
        ("kv_reuse", 4, 5, 1),
        ("kv_reuse", 9, None, 3),
        ("bulk", None, None, 7),
    ],
    ids=[
        "tp-rli0",
        "rli0",
        "rli1",
        "rli2",
        "rli3-capped",
        "consumer-passed",
        "no-job-index",
        "bulk",
    ],
)
def test_implicit_flow_level_from_rli(
    cls: str, consumer: int | None, current: int | None, level: int
) -> None:
    flow = build_flow(cls=cls, job="j", consumer_index=consumer)
    job_index = {} if current is None else {"j": current}
    assert policy().admit(flow, ctx(job_index=job_index)).level == level


@pytest.mark.parametrize(
    ("cls", "consumer", "level"),
    [("tp", None, 1), ("experience", 5, 2), ("experience", 6, 3), ("kv_reuse", 9, 3)],
    ids=["tp-alone-on-level-1", "rli0-below-tp", "rli1", "rli4-capped"],
)
def test_collectives_first_gives_tp_its_own_early_level(
    cls: str, consumer: int | None, level: int
) -> None:
    flow = build_flow(cls=cls, job="j", consumer_index=consumer)
    pol = policy(collectives_first=True)
    assert pol.admit(flow, ctx(job_index={"j": 5})).level == level
    assert pol.describe_levels()[1].startswith("early: tp collectives")


def test_explicit_flow_without_size_or_deadline_uses_unknown_level() -> None:
    assert policy().admit(build_flow(cls="kv", deadline=1.0), ctx()).level == 3
    assert policy().admit(build_flow(cls="param_sync", size=10), ctx()).level == 3
    assert policy(unknown_level=5).admit(build_flow(cls="kv"), ctx()).level == 5


def test_promotion_as_deadline_nears() -> None:
    # 1e8 bytes due at t=1: MLU 0.1 at t=0 (level 5), 0.2 at t=0.5 (4), 0.667 at t=0.85 (0)
    pol = policy()
    flow = build_flow(cls="kv", size=int(1e8), deadline=1.0)
    flow.level = pol.admit(flow, ctx(0.0)).level
    assert flow.level == 5
    seen = []
    for now in (0.5, 0.85, 0.9):
        for fid, decision in pol.reevaluate([flow], ctx(now)).items():
            assert fid == flow.flow_id
            flow.level = decision.level
        seen.append(flow.level)
    assert seen == [4, 0, 0]


@pytest.mark.parametrize(
    ("lead", "now", "level"),
    [(0.0, 0.5, 4), (0.3, 0.5, 0), (0.3, 0.0, 4), (0.0, 0.0, 5), (0.3, 0.71, 0), (0.0, 0.71, 4)],
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
    assert flow.level == 0
    flow.sent = flow.size or 0  # nothing left: MLU 0 would be the lowest band
    assert pol.reevaluate([flow], ctx(0.1)) == {}
    exp = build_flow(2, cls="experience", job="j", consumer_index=6)
    exp.level = pol.admit(exp, ctx(job_index={"j": 6})).level
    assert exp.level == 1
    assert pol.reevaluate([exp], ctx(job_index={"j": 0})) == {}


def test_rho_sources() -> None:
    # links a (2e9 B/s) and b (4e9 B/s); 2.5e8 bytes due in 1 s. Another flow kept a at 75%
    # for 10 windows (rho_window 0.01 s), so its windowed load is ~0.75 whatever Context says.
    links = {"link_bandwidth": {"a": 2e9, "b": 4e9}, "link_load": {"a": 0.0, "b": 0.0}}
    for source, expected in (("none", 0.125), ("link", 0.5), ("others", 0.5)):
        pol = policy(rho_source=source, rho_window=0.01)
        other = build_flow(9, cls="bulk", size=10**12, links=("a",))
        pol.admit(other, ctx(0.0, **links))
        other.sent = int(0.75 * 2e9 * 0.1)
        pol.reevaluate([other], ctx(0.1, **links))
        flow = build_flow(cls="kv", size=int(2.5e8), deadline=1.1, links=("a", "b"))
        pol.admit(flow, ctx(0.1, **links))
        assert pol.flow_mlu(flow, ctx(0.1, **links)) == pytest.approx(expected, rel=1e-3), source


def test_rho_is_capped_at_max_load() -> None:
    pol = policy(rho_source="link", rho_window=0.01, max_load=0.8)
    hog = build_flow(9, cls="bulk", size=10**12, links=("a",))
    pol.admit(hog, ctx(0.0))
    hog.sent = int(B * 1.0)  # the link full for 1 s
    pol.reevaluate([hog], ctx(1.0))
    flow = build_flow(cls="kv", size=int(1e8), deadline=2.0, links=("a",))
    assert pol.flow_mlu(flow, ctx(1.0)) == pytest.approx(1e8 / (1.0 * B * 0.2))


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


def test_starved_flow_is_not_promoted_by_a_burst() -> None:
    # The bug this guards against: the own share measured since the previous evaluation
    # (< 1 ms) read a flow briefly starved by a TP burst as rho = max_load: MLU x10 and, since
    # rmlq never demotes, level 0 for good.
    pol = policy(rho_source="others", rho_window=0.05)
    sync = build_flow(1, cls="param_sync", size=int(1e9), deadline=4.0, links=("a",))
    other = build_flow(2, cls="tp", size=10**12, links=("a",))
    for flow in (sync, other):
        flow.level = pol.admit(flow, ctx(0.0, link_load={"a": 0.92})).level
    assert sync.level == 4  # MLU 1e9 / (4 s x 1e9 B/s) = 0.25: band [0.125, 0.5)
    sync.sent = other.sent = int(0.25e9)  # half the link each for 0.5 s
    assert pol.reevaluate([sync, other], ctx(0.5)) == {}  # MLU 0.75e9 / (3.5e9 x 0.5) = 0.43
    other.sent += int(1e6)  # a 1 ms burst of the other flow; the sync sends nothing
    assert pol.reevaluate([sync, other], ctx(0.501, link_load={"a": 1.0})) == {}
    assert pol.flow_mlu(sync, ctx(0.501)) == pytest.approx(0.43, abs=0.01)


@pytest.mark.parametrize(
    ("deadlines", "red"),
    [([3.0], 3.0), ([1.0, 2.0, 10.0, 11.0], 5.5), ([1.0, 1.1, 1.2, 5.0], 2.0), ([2.0, 2.0], 2.0)],
    ids=["single", "two-two", "three-one", "equal"],
)
def test_robust_effective_deadline(deadlines: list[float], red: float) -> None:
    assert rmlq.robust_effective_deadline(deadlines) == pytest.approx(red)


def test_red_orders_equal_rli_flows_across_requests() -> None:
    # K=12, R=5, T=2: slots RLI0/tight=1, RLI0/loose=2, RLI1/tight=3, RLI1/loose=4, rest=5
    pol = policy(12, early_levels=5, red_tiers=2)
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
    assert {fid: d.level for fid, d in decisions.items()} == {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 1}


def _explicit(flow_id: int, request: str, size: float) -> Flow:
    return build_flow(flow_id, cls="kv", size=int(size), deadline=1.0, request=request)


def test_feasibility_prunes_hopeless_request_after_grace() -> None:
    pol = policy(feasibility=True, feasibility_grace=0.01)
    hopeless = _explicit(1, "r", 2e9)  # MLU 2 at t=0
    sibling = _explicit(2, "r", 1e6)  # feasible, same request
    collective = build_flow(3, cls="tp", request="r")
    other = _explicit(4, "q", 2e8)
    flows = [hopeless, sibling, collective, other]
    for flow in flows:
        flow.level = pol.admit(flow, ctx()).level
    assert [f.level for f in flows] == [0, 6, 1, 4]
    assert pol.reevaluate(flows, ctx(0.005)) == {}
    decisions = pol.reevaluate(flows, ctx(0.011))
    assert {fid: d.level for fid, d in decisions.items()} == {1: 7, 2: 7}
    for flow in flows:
        pol.release(flow, ctx(0.02))
    assert pol._pruned == {"r"}  # kept for the request's later flows (request_memory = 1 s)
    pol.reevaluate([], ctx(0.5))
    assert pol._pruned == {"r"}
    pol.reevaluate([build_flow(9, cls="tp")], ctx(1.03))
    assert not pol._pruned and not pol._infeasible_since and not pol._request_flows


@pytest.mark.parametrize(("load", "pruned"), [("rho", True), ("none", False)])
def test_feasibility_load_judges_against_residual_or_whole_link(load: str, pruned: bool) -> None:
    # another flow keeps link a (1e9 B/s) 75% busy; 6e8 bytes due in 1 s: MLU 0.6 on the whole
    # link (feasible at the top level), 2.4 on the residual 25% (hopeless for "rho")
    links = {"link_bandwidth": {"a": B}, "link_load": {"a": 0.0}}
    pol = policy(feasibility=True, rho_window=0.01, feasibility_load=load)
    other = build_flow(9, cls="bulk", size=10**12, links=("a",))
    pol.admit(other, ctx(0.0, **links))
    other.sent = int(0.75 * B * 0.1)
    pol.reevaluate([other], ctx(0.1, **links))
    flow = _explicit(1, "r", 6e8)
    flow.links, flow.deadline = ("a",), 1.1
    flow.level = pol.admit(flow, ctx(0.1, **links)).level
    assert flow.level == (7 if pruned else 0)
    assert pol.is_pruned(flow) is pruned


def _per_layer(flow_id: int, request: str = "r", *, size: float = 1e6, **fields: Any) -> Flow:
    fields.setdefault("deadline", 1.0)
    return build_flow(flow_id, cls="kv", size=int(size), request=request, **fields)


# Each case: the request's flows in order, (admission time, bytes, deadline), each released
# before the next opens (per-layer P2D flows); whether the last one is pruned. grace = 10 ms:
# MLU > 1 (bytes / (time left x 1e9 B/s)) must hold 10 ms, timed per request, not per flow.
@pytest.mark.parametrize(
    ("flows", "pruned"),
    [
        ([(0.0, 1e6, 1.0)], False),
        ([(1.5, 1e6, 1.0)], True),
        ([(0.999, 2e6, 1.0)], False),
        ([(0.999, 2e6, 1.0), (0.9995, 2e6, 1.0)], False),
        ([(0.990, 1e8, 1.0), (0.995, 1e8, 1.0), (1.0001, 1e6, 1.0)], True),
        ([(0.980, 3e7, 1.0), (0.986, 2e7, 1.0), (0.9905, 1e7, 1.0)], True),
        ([(0.980, 3e7, 1.0), (0.986, 1e3, 1.0), (0.9905, 1e7, 1.0)], False),
    ],
    ids=[
        "on-time",
        "deadline-passed-prunes-at-once",
        "mlu-2-within-grace",
        "second-flow-still-within-grace",
        "deadline-passes-between-layers",
        "grace-spans-per-layer-flows",
        "feasible-flow-resets-timer",
    ],
)
def test_feasibility_judges_requests_across_their_per_layer_flows(
    flows: list[tuple[float, float, float]], pruned: bool
) -> None:
    pol = policy(feasibility=True, feasibility_grace=0.01)
    flow = _per_layer(0)
    for flow_id, (now, size, deadline) in enumerate(flows):
        flow = _per_layer(flow_id, size=size, deadline=deadline)
        flow.level = pol.admit(flow, ctx(now)).level
        pol.reevaluate([flow], ctx(now))
        pol.release(flow, ctx(now))
    assert pol.is_pruned(flow) is pruned
    assert (flow.level == 7) is pruned


def test_prune_classes_spare_param_sync_by_default() -> None:
    late = build_flow(1, cls="param_sync", size=10**6, deadline=1.0, request="sync")
    assert policy(feasibility=True).admit(late, ctx(2.0)).level == 0
    pol = policy(feasibility=True, prune_classes=["kv", "param_sync"])
    assert pol.admit(late, ctx(2.0)).level == 7


def test_pruned_request_keeps_its_collectives_and_releases_state_per_flow_without_request() -> None:
    pol = policy(feasibility=True)
    collective = build_flow(1, cls="tp", request="r")
    late = _per_layer(2, deadline=0.5)
    lone = build_flow(3, cls="kv", size=10, deadline=0.5)  # no request: keyed by flow
    levels = [pol.admit(f, ctx(1.0)).level for f in (collective, late, lone)]
    assert levels == [1, 7, 7]
    pol.release(lone, ctx(1.0))
    assert pol._pruned == {"r"}


def test_past_deadline_stays_on_top_without_feasibility() -> None:
    pol = policy()
    flow = _explicit(1, "r", 2e9)
    flow.level = pol.admit(flow, ctx()).level
    assert flow.level == 0
    assert pol.reevaluate([flow], ctx(5.0)) == {}


def test_feasibility_recovers_before_grace() -> None:
    pol = policy(feasibility=True, feasibility_grace=0.01)
    flow = _explicit(1, "r", 2e9)
    flow.level = pol.admit(flow, ctx()).level
    flow.sent = int(1.5e9)  # MLU 0.5 / 0.995 -> feasible again
    pol.reevaluate([flow], ctx(0.005))
    assert pol.reevaluate([flow], ctx(0.02)) == {}
    assert not pol.is_pruned(flow)


@pytest.mark.parametrize(
    ("num_levels", "args", "message"),
    [
        (5, {}, "early_levels"),
        (8, {"unknown_level": 8}, "unknown_level"),
    ],
    ids=["too-few-levels", "unknown-level-out-of-range"],
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
    ],
)
def test_validate_names_field(args: dict[str, Any], fragment: str) -> None:
    errors = rmlq.validate(args, "policy.args")
    assert any(fragment in e for e in errors), errors


def test_describe_levels_covers_every_level() -> None:
    assert len(policy().describe_levels()) == 8
    assert len(policy(12, early_levels=5, red_tiers=2).describe_levels()) == 12


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
    num_levels=st.integers(6, 12),
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
                assert feasibility and pol.is_pruned(flow) and decision.level == num_levels - 1
            flow.level = decision.level


def test_zero_bandwidth_link_means_infinite_mlu() -> None:
    assert rmlq.mlu(1e6, 1.0, 0.0, 0.0) == float("inf")
    flow = build_flow(cls="kv", size=10, deadline=5.0, links=("dead",))
    assert policy().admit(flow, ctx(link_bandwidth={"dead": 0.0})).level == 0
