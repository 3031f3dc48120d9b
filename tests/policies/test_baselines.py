"""Baselines fair/static/sjf/pias/edf/karuna/llf against hand-computed cases."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_flows import build_flow

from flowsched.model import Context, Flow
from flowsched.policies import create, edf, karuna, llf, pias, sjf

MiB = 1 << 20


def ctx(now: float = 0.0, **fields: Any) -> Context:
    fields.setdefault("default_bandwidth", 1e9)
    return Context(now=now, **fields)


def levels(
    policy_name: str, flows: list[Flow], num_levels: int = 8, now: float = 0.0, **args: Any
) -> list[int]:
    """Apply one reevaluate to flows that start unassigned and return their levels."""
    pol = create(policy_name, args, num_levels=num_levels)
    for fid, decision in pol.reevaluate(flows, ctx(now)).items():
        next(f for f in flows if f.flow_id == fid).level = decision.level
    return [f.level for f in flows]


# -- fair -----------------------------------------------------------------------------------


def test_fair_puts_everything_on_one_level() -> None:
    flows = [build_flow(1, cls="tp"), build_flow(2, cls="kv", size=5, deadline=1.0)]
    assert levels("fair", flows) == [7, 7]
    assert levels("fair", [build_flow(3)], level=2) == [2]


# -- static ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_levels", "args", "expected"),
    [
        (8, {}, {"tp": 0, "kv": 1, "param_sync": 2, "kv_reuse": 2, "experience": 3, "bulk": 7}),
        (3, {}, {"tp": 0, "kv": 1, "param_sync": 2, "kv_reuse": 2, "experience": 2, "bulk": 2}),
        (4, {"levels": {"tp": 1, "bulk": 0}}, {"tp": 1, "kv": 1, "experience": 3, "bulk": 0}),
    ],
    ids=["defaults-K8", "defaults-clamped-K3", "override"],
)
def test_static_mapping(num_levels: int, args: dict[str, Any], expected: dict[str, int]) -> None:
    flows = [build_flow(i, cls=label) for i, label in enumerate(expected)]
    assert dict(zip(expected, levels("static", flows, num_levels, **args), strict=True)) == expected


def test_static_rejects_out_of_range_and_unknown_class() -> None:
    with pytest.raises(ValueError, match=r"policy.args.levels.tp: 9 is outside 0..7"):
        create("static", {"levels": {"tp": 9}})
    with pytest.raises(ValueError, match=r"policy.args.levels.web: unknown flow class"):
        create("static", {"levels": {"web": 1}})


# -- sjf ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "sent", "level"),
    [
        (0, 0, 0),
        (MiB - 1, 0, 0),
        (MiB, 0, 1),
        (4 * MiB - 1, 0, 1),
        (4 * MiB, 0, 2),
        (64 * MiB, 0, 4),
        (10**12, 0, 6),
        (8 * MiB, 7 * MiB + 1, 0),
        (None, 0, 7),
    ],
    ids=[
        "empty",
        "below-base",
        "base",
        "below-4MiB",
        "4MiB",
        "64MiB",
        "huge",
        "drained",
        "unknown",
    ],
)
def test_sjf_geometric_bands(size: int | None, sent: int, level: int) -> None:
    assert levels("sjf", [build_flow(cls="bulk", size=size, sent=sent)]) == [level]


def test_sjf_size_level_with_custom_bands() -> None:
    args = sjf.Args(base=100, ratio=10)
    assert [sjf.size_level(r, args, 4) for r in (99, 100, 999, 1000, 10**9, None)] == [
        0,
        1,
        1,
        2,
        2,
        3,
    ]


# -- pias -----------------------------------------------------------------------------------


def test_pias_threshold_separates_a_two_point_distribution() -> None:
    # 90% of flows are 1 byte, 10% are 100 bytes, load 0.5, 2 queues. Modelled mean FCT:
    # threshold 1 -> 0.9216 + 15.29 ~= 16.2; threshold 100 (one FIFO-like queue) -> ~56.8.
    assert pias.derive_thresholds([1.0] * 9 + [100.0], 0.5, 2) == (1.0,)


def test_pias_thresholds_are_sorted_and_one_per_boundary() -> None:
    thresholds = pias.resolve_thresholds(pias.Args(), 8)
    assert len(thresholds) == 7
    assert list(thresholds) == sorted(thresholds)
    assert 0 < thresholds[0] < thresholds[-1] <= 30e6


def test_pias_samples_from_uniform_cdf() -> None:
    samples = pias.samples_from_cdf([(0, 0.0), (100, 1.0)], count=10)
    assert samples == pytest.approx([5, 15, 25, 35, 45, 55, 65, 75, 85, 95])


@pytest.mark.parametrize(
    ("sent", "level"),
    [(0, 0), (99, 0), (100, 1), (999, 1), (1000, 2), (10**9, 2)],
    ids=["0", "99", "100", "999", "1000", "huge"],
)
def test_pias_demotes_by_bytes_sent(sent: int, level: int) -> None:
    flow = build_flow(cls="bulk", sent=sent)
    assert levels("pias", [flow], 3, thresholds=[100, 1000]) == [level]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"thresholds": [5, 1]}, "policy.args.thresholds: must not decrease"),
        (
            {"size_cdf": [[0, 0.0], [10, 0.5]]},
            "policy.args.size_cdf[1]: the last probability must be 1",
        ),
        ({"size_cdf": [[5, 0.5], [1, 1.0]]}, "policy.args.size_cdf[1]: sizes and probabilities"),
        ({"size_samples": [1], "size_cdf": [[0, 0], [1, 1]]}, "either size_samples or size_cdf"),
        ({"load": 1.5}, "policy.args.load"),
    ],
    ids=["decreasing", "cdf-not-1", "cdf-decreasing", "both", "load"],
)
def test_pias_validate(args: dict[str, Any], fragment: str) -> None:
    assert any(fragment in e for e in pias.validate(args, "policy.args"))


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(["pias", "karuna"]),
    low=st.floats(1.0, 1e15),
    spread=st.integers(1, 3),
    count=st.integers(1, 4),
    load=st.sampled_from([1.0, 0.999999999999]),
    num_levels=st.integers(2, 12),
)
def test_pias_thresholds_derive_at_full_load_from_any_valid_samples(
    name: str, low: float, spread: int, count: int, load: float, num_levels: int
) -> None:
    """Load 1 (what validate accepts) with the largest sizes a few ulps apart: the load of the
    sizes below the largest rounds to the whole load, and the derivation divided by 0
    (ZeroDivisionError from create, 'policy: float division by zero' from policy check)."""
    top = low
    for _ in range(spread):
        top = math.nextafter(top, math.inf)
    samples = [low] * count + [top]
    args = {"size_samples": samples, "load": load}
    assert pias.validate(args, "policy.args") == []
    policy = create(name, args, num_levels=num_levels)
    thresholds = list(policy.thresholds)  # type: ignore[attr-defined]
    assert thresholds == sorted(thresholds)
    assert all(math.isfinite(t) for t in thresholds)


@pytest.mark.parametrize("num_levels", [8, 12, 16, 64])
@pytest.mark.parametrize(
    ("name", "args", "top"),
    [
        ("pias", {}, 0),
        ("karuna", {}, 1),
        ("pias", {"size_samples": [1e3, 1e6, 1e9]}, 0),
        ("pias", {"size_samples": [4096.0]}, 0),
    ],
    ids=["pias-web-search", "karuna-web-search", "pias-three-sizes", "pias-one-size"],
)
def test_derived_thresholds_start_new_flows_at_the_top_level(
    name: str, args: dict[str, Any], top: int, num_levels: int
) -> None:
    """More levels than the distribution has use for: the derivation gave the spare queues
    threshold 0, first, and a flow that had sent nothing started below them all (web-search
    CDF at K=16: level 5; one flow size: every flow at K-1, the scavenger's DSCP)."""
    pol = create(name, args, num_levels=num_levels)
    thresholds = list(pol.thresholds)  # type: ignore[attr-defined]
    assert thresholds == sorted(thresholds) and all(t > 0 for t in thresholds)
    assert pol.admit(build_flow(1, cls="bulk"), ctx()).level == top
    assert pol.admit(build_flow(2, cls="bulk", sent=10**12), ctx()).level == num_levels - 1


def test_pias_threshold_count_must_match_levels() -> None:
    with pytest.raises(ValueError, match="expected 7 thresholds"):
        create("pias", {"thresholds": [1, 2]}, num_levels=8)


# -- edf ------------------------------------------------------------------------------------


def test_edf_orders_explicit_deadlines_and_shares_the_rest() -> None:
    flows = [
        build_flow(1, cls="kv", deadline=3.0, size=10),
        build_flow(2, cls="param_sync", deadline=1.0),
        build_flow(3, cls="kv", deadline=2.0, size=10),
        build_flow(4, cls="tp"),
        build_flow(5, cls="experience", deadline=0.5),  # implicit class: not EDF-ranked
    ]
    assert levels("edf", flows) == [2, 0, 1, 7, 7]


def test_edf_rank_banding_with_more_flows_than_levels() -> None:
    flows = [build_flow(i, cls="kv", deadline=float(i)) for i in range(4)]
    assert levels("edf", flows, num_levels=3) == [0, 0, 1, 1]


def test_edf_admit_ranks_among_known_deadlines() -> None:
    pol = edf.EdfPolicy(edf.Args(), 3)
    assert pol.admit(build_flow(1, cls="kv", deadline=5.0), ctx()).level == 0
    assert pol.admit(build_flow(2, cls="kv", deadline=1.0), ctx()).level == 0
    assert pol.admit(build_flow(3, cls="kv", deadline=6.0), ctx()).level == 1  # rank 2 of 3
    pol.release(build_flow(2, cls="kv", deadline=1.0), ctx())
    assert pol._ranks._sorted == [5.0, 6.0]


# -- karuna ---------------------------------------------------------------------------------


def test_karuna_paces_deadline_flows_at_the_minimum_rate() -> None:
    pol = karuna.KarunaPolicy(karuna.Args(thresholds=[100, 1000]), 4)
    flow = build_flow(1, cls="kv", size=int(1e8), deadline=2.0)
    decision = pol.admit(flow, ctx())
    assert decision.level == 0
    assert decision.rate == pytest.approx(1e8 / 2.0 * 1.05)
    flow.level = 0
    flow.sent = int(1e6)  # rate 5.2e7 * 1.05 ~ 1% lower at t=0.001: inside the tolerance
    assert pol.reevaluate([flow], ctx(0.001)) == {}
    late = pol.reevaluate([flow], ctx(1.5)).get(1)
    assert late is not None and late.rate == pytest.approx(9.9e7 / 0.5 * 1.05)
    assert pol.reevaluate([flow], ctx(2.5))[1].rate is None  # past the deadline: uncapped


@pytest.mark.parametrize(
    ("flow", "level"),
    [
        (build_flow(1, cls="tp", size=50), 1),
        (build_flow(1, cls="experience", size=500), 2),
        (build_flow(1, cls="param_sync", size=5000), 3),  # no deadline: SJF
        (build_flow(1, cls="bulk", size=5000, sent=4950), 1),
        (build_flow(1, cls="tp"), 1),
        (build_flow(1, cls="tp", sent=150), 2),
        (build_flow(1, cls="kv", deadline=1.0, sent=5000), 3),  # size unknown: PIAS
    ],
    ids=["sjf-small", "sjf-mid", "sjf-large", "sjf-remaining", "pias-new", "pias-150", "pias-kv"],
)
def test_karuna_non_deadline_flows(flow: Flow, level: int) -> None:
    pol = karuna.KarunaPolicy(karuna.Args(thresholds=[100, 1000]), 4)
    assert pol.admit(flow, ctx()) == karuna.Decision(level)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            {"headrom": 0.1},
            "policy.args.headrom: unknown key (known: headroom, rate_tolerance, thresholds, "
            "size_samples, size_cdf, load)",
        ),
        ({"headroom": -1}, "policy.args.headroom: expected a number in [0.0, 10.0], got -1"),
        ({"thresholds": [5, 1]}, "policy.args.thresholds: must not decrease"),
    ],
    ids=["misspelt-own-key", "own-key", "pias-key"],
)
def test_karuna_validate(args: dict[str, Any], expected: str) -> None:
    """An unknown key's message listed pias's keys only, not karuna's own (a misspelt
    ``headroom`` was told the known keys are thresholds, size_samples, size_cdf, load)."""
    assert karuna.validate(args, "policy.args") == [expected]


# -- llf ------------------------------------------------------------------------------------


def test_llf_ranks_by_laxity() -> None:
    flows = [
        build_flow(1, cls="kv", deadline=10.0, size=int(5e9)),  # laxity 10 - 5 = 5
        build_flow(2, cls="kv", deadline=4.0, size=0),  # laxity 4
        # a collective's deadline is its isolated completion, 0 + 1 s: laxity 0 (its
        # oracle_deadline, the consumer's start, is ignored)
        build_flow(3, cls="tp", oracle_deadline=8.0, size=int(1e9)),
        build_flow(4, cls="bulk"),  # no deadline
        build_flow(5, cls="kv", deadline=4.5, oracle_deadline=20.0),  # oracle wins: laxity 20
    ]
    assert levels("llf", flows) == [2, 1, 0, 7, 3]
    assert llf.laxity(flows[0], ctx(1.0)) == pytest.approx(4.0)


def test_llf_admit_uses_latest_start_times() -> None:
    pol = llf.LlfPolicy(llf.Args(), 8)
    assert pol.admit(build_flow(1, cls="kv", deadline=10.0, size=int(1e9)), ctx()).level == 0
    assert pol.admit(build_flow(2, cls="kv", deadline=2.0, size=int(1e9)), ctx()).level == 0
    assert pol.admit(build_flow(3, cls="kv", deadline=5.0), ctx()).level == 1
    pol.release(build_flow(2, cls="kv", deadline=2.0, size=int(1e9)), ctx())
    assert pol._ranks._sorted == [5.0, 9.0]


@given(remaining=st.integers(0, 10**13), num_levels=st.integers(1, 12))
def test_sjf_policy_agrees_with_size_level(remaining: int, num_levels: int) -> None:
    pol = sjf.SjfPolicy(sjf.Args(), num_levels)
    level = pol.admit(build_flow(cls="bulk", size=remaining), ctx()).level
    assert level == sjf.size_level(remaining, sjf.Args(), num_levels)
    assert 0 <= level <= max(num_levels - 2, 0)


def test_pias_thresholds_from_a_size_cdf() -> None:
    # the CDF puts 90% of flows at 1 byte and 10% at 100 bytes: the two-point case above
    cdf = [[0, 0.0], [1, 0.9], [100, 0.9], [100, 1.0]]
    pol = create("pias", {"size_cdf": cdf, "load": 0.5}, num_levels=2)
    assert isinstance(pol, pias.PiasPolicy)
    assert pol.thresholds == (1.0,)


def test_llf_zero_bandwidth_is_most_urgent() -> None:
    flows = [
        build_flow(1, cls="kv", deadline=1.0, size=0),
        build_flow(2, cls="kv", deadline=9.0, size=10, links=("dead",)),
    ]
    pol = create("llf", num_levels=8)
    decisions = pol.reevaluate(flows, ctx(link_bandwidth={"dead": 0.0}))
    assert {fid: d.level for fid, d in decisions.items()} == {1: 1, 2: 0}


@pytest.mark.parametrize(
    ("flow", "now", "expected"),
    [
        # opened at 1 s, 1e9 bytes at 1e9 B/s: deadline 2 s; held back until 1.5 s with 0.2e9
        # sent, it can finish at 2.3 s: laxity -0.3 s
        (build_flow(1, cls="tp", opened_at=1.0, size=int(1e9), sent=int(2e8)), 1.5, -0.3),
        (build_flow(1, cls="tp", opened_at=1.0, size=int(1e9)), 1.0, 0.0),  # fresh: laxity 0
        (build_flow(1, cls="tp", opened_at=1.0), 1.5, -0.5),  # size unknown: due when opened
        (build_flow(1, cls="tp", opened_at=1.0, size=int(1e9), oracle_deadline=1.0), 1.0, 0.0),
    ],
    ids=["held-back", "fresh", "unknown-size", "oracle-deadline-ignored"],
)
def test_llf_collective_deadline_is_its_isolated_completion(
    flow: Flow, now: float, expected: float
) -> None:
    assert llf.laxity(flow, ctx(now)) == pytest.approx(expected)


# -- late-dropping baselines ----------------------------------------------------------------

LATE_DROP_POLICIES = ("static", "edf", "llf")


def late_flows() -> list[Flow]:
    """At now = 2: kv 1 is late, kv 2 on time, kv 3 late but done, param_sync 4 late, tp 5."""
    return [
        build_flow(1, cls="kv", size=100, deadline=1.0, request="r1"),
        build_flow(2, cls="kv", size=100, deadline=3.0, request="r2"),
        build_flow(3, cls="kv", size=100, sent=100, deadline=1.0, request="r3"),
        build_flow(4, cls="param_sync", size=100, deadline=1.5),
        build_flow(5, cls="tp", size=100),
    ]


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("static", {}, [1, 1, 1, 2, 0]),
        ("static", {"drop_late": True}, [7, 1, 1, 2, 0]),
        ("static", {"drop_late": True, "drop_classes": ["kv", "param_sync"]}, [7, 1, 1, 7, 0]),
        ("static", {"drop_late": True, "drop_classes": []}, [1, 1, 1, 2, 0]),
        # edf: ranks 1 < 1.5 < 3 (kv 3's deadline too), fair level K-1 for tp
        ("edf", {}, [0, 3, 1, 2, 7]),
        # drop_late: ranks on 0..5, everything else on 6, late kv on the scavenger level 7
        ("edf", {"drop_late": True}, [7, 2, 0, 1, 6]),
        # llf: latest starts kv 1 -> 1 - 1e-7, kv 3 -> 1, param_sync 1.5, kv 2 3, tp 0 + 1e-7
        ("llf", {}, [1, 4, 2, 3, 0]),
        ("llf", {"drop_late": True}, [7, 3, 1, 2, 0]),
    ],
    ids=[
        "static",
        "static-drop",
        "static-drop-both",
        "static-drop-none",
        "edf",
        "edf-drop",
        "llf",
        "llf-drop",
    ],
)
def test_late_dropping(name: str, args: dict[str, Any], expected: list[int]) -> None:
    assert levels(name, late_flows(), now=2.0, **args) == expected
    admitted = create(name, args, num_levels=8)
    first = admitted.admit(late_flows()[0], ctx(2.0)).level
    assert (first == 7) == (expected[0] == 7)  # admission drops a late flow too


@pytest.mark.parametrize("name", LATE_DROP_POLICIES)
def test_late_dropping_turns_on_at_the_deadline(name: str) -> None:
    flow = build_flow(1, cls="kv", size=100, deadline=1.0)
    policy = create(name, {"drop_late": True}, num_levels=8)
    flow.level = policy.admit(flow, ctx(0.5)).level
    assert flow.level < 7
    assert policy.reevaluate([flow], ctx(1.0))[1].level == 7
    flow.level = 7
    assert policy.reevaluate([flow], ctx(1.5)) == {}  # stays dropped


@pytest.mark.parametrize("name", ["static", "edf"])
def test_late_dropping_sets_a_timer_for_the_deadline(name: str) -> None:
    flow = build_flow(1, cls="kv", size=100, deadline=1.0)
    policy = create(name, {"drop_late": True}, num_levels=8)
    flow.level = policy.admit(flow, ctx(0.5)).level
    assert policy.next_change(flow, ctx(0.5)) == 1.0  # type: ignore[attr-defined]
    flow.level = 7
    # no further change by time alone: a past time would re-arm the coordinator's timer each tick
    assert policy.next_change(flow, ctx(1.5)) is None  # type: ignore[attr-defined]
    plain = create(name, {}, num_levels=8)
    assert plain.next_change(flow, ctx(0.5)) is None  # type: ignore[attr-defined]


def test_llf_has_no_timers_since_its_ranks_move_as_bytes_flow() -> None:
    """Laxity falls as a flow waits and stays as it sends: time alone re-ranks, so the
    coordinator and the simulator sweep llf instead of waiting for timers."""
    assert not hasattr(create("llf", {"drop_late": True}, num_levels=8), "next_change")


@pytest.mark.parametrize("name", LATE_DROP_POLICIES)
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"drop_late": "yes"}, "policy.args.drop_late: expected true or false"),
        ({"drop_late": 1}, "policy.args.drop_late: expected true or false"),
        ({"drop_classes": ["tp"]}, "policy.args.drop_classes[0]: expected one of 'kv'"),
        ({"drop_classes": "kv"}, "policy.args.drop_classes: expected a list"),
    ],
    ids=["string", "int", "implicit-class", "not-a-list"],
)
def test_late_dropping_arguments_are_validated(
    name: str, args: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        create(name, args)


@pytest.mark.parametrize(
    ("name", "num_levels", "expected"),
    [
        ("static", 4, ["tp", "kv", "param_sync, kv_reuse", "experience, bulk; late kv"]),
        ("edf", 3, ["explicit deadlines, rank band 0", "everything else (fair)",
                    "late kv (drop_late)"]),
        ("edf", 2, ["explicit deadlines, rank band 0; everything else (fair)",
                    "late kv (drop_late)"]),
    ],
    ids=["static", "edf-K3", "edf-K2"],
)  # fmt: skip
def test_late_dropping_in_describe_levels(name: str, num_levels: int, expected: list[str]) -> None:
    policy = create(name, {"drop_late": True}, num_levels=num_levels)
    assert policy.describe_levels() == expected  # type: ignore[attr-defined]
