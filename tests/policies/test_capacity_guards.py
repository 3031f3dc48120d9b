"""Policies under capacities no link has (0, denormal) and samples no meter should keep (inf,
NaN): no exception, no NaN kept, and the same decisions as before for real capacities; the
meter forgets the links no open flow uses (docs/security.md)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from policy_flows import build_flow

from flowsched.model import Context, Flow
from flowsched.policies import create, rmlq
from flowsched.policies.common import MIN_BANDWIDTH, PRUNE_WINDOWS, TrafficMeter, bottleneck


def _ctx(now: float, **fields: Any) -> Context:
    fields.setdefault("default_bandwidth", 1e9)
    return Context(now=now, **fields)


@pytest.mark.parametrize(
    ("capacities", "expected"),
    [
        ({"a": 25e9}, 25e9),
        ({"a": 25e9, "b": 1e9}, 1e9),
        ({"a": 1.0}, 1.0),
        ({"a": 0.5}, MIN_BANDWIDTH),
        ({"a": 0.0}, MIN_BANDWIDTH),
        ({"a": 5e-324, "b": 1e9}, MIN_BANDWIDTH),
        ({"a": math.nan}, MIN_BANDWIDTH),
    ],
)
def test_the_bottleneck_is_at_least_one_byte_per_second(
    capacities: dict[str, float], expected: float
) -> None:
    flow = build_flow(1, links=tuple(capacities))
    assert bottleneck(flow, _ctx(0.0, link_bandwidth=capacities)) == expected


def _poisoned_run(capacity: float, args: dict[str, Any]) -> list[int]:
    """rmlq over KV layers of one request on a link of ``capacity``, with progress, timers and
    a close: the levels it gave (every hook called as the coordinator calls it)."""
    policy = create("rmlq", args, num_levels=8)
    assert isinstance(policy, rmlq.RmlqPolicy)
    bandwidth = {"victim:tx": capacity}
    levels = []
    flows: list[Flow] = []
    for step in range(8):
        now = 100.0 + 0.01 * step
        ctx = _ctx(now, link_bandwidth=bandwidth)
        flow = build_flow(
            step + 1, "kv", size=10**8, deadline=101.0, request="r", consumer_index=step,
            links=("victim:tx",), opened_at=now,
        )  # fmt: skip
        flow.level = policy.admit(flow, ctx).level
        flows.append(flow)
        for other in flows:
            other.sent = min(other.sent + 10**7, 10**8)
        for fid, decision in policy.reevaluate(flows, ctx).items():
            next(f for f in flows if f.flow_id == fid).level = decision.level
        for other in flows:
            when = policy.next_change(other, ctx)
            assert when is None or (math.isfinite(when) and when > now)
        levels += [other.level for other in flows]
    policy.release(flows[0], _ctx(100.1, link_bandwidth=bandwidth))
    assert all(0 <= level < 8 for level in levels)
    return levels


@pytest.mark.parametrize("capacity", [0.0, 5e-324, 1e-300, 0.5])
@pytest.mark.parametrize(
    "args",
    [
        {},
        {"rho_source": "others"},
        {"rho_source": "link"},
        {"pace_layers": 2},
        {"feasibility": True, "feasibility_check": "alg1"},
        {"deferred_order": "mlu"},
    ],
)
def test_rmlq_decides_on_a_poisoned_capacity_without_raising(
    capacity: float, args: dict[str, Any]
) -> None:
    _poisoned_run(capacity, args)


@pytest.mark.parametrize(
    ("capacity", "elapsed"),
    [
        (5e-324, 1.0),  # a denormal capacity: the sample would be inf
        (0.0, 1.0),
        (1e9, 5e-324),  # bytes over a vanishing interval
        (1e-300, 1e-300),
    ],
)
@pytest.mark.parametrize("flow_rates", [False, True])
def test_the_meter_never_keeps_a_non_finite_utilization(
    capacity: float, elapsed: float, flow_rates: bool
) -> None:
    meter = TrafficMeter(0.05, flow_rates=flow_rates)
    flow = build_flow(1, "kv", size=10**12, links=("victim:tx",))
    flow.level = 3
    meter.open(flow, 0.0)
    ctx = _ctx(0.0, link_bandwidth={"victim:tx": capacity})
    meter.update([flow], ctx)
    for now in (elapsed, 1.0 + elapsed, 2.0 + elapsed):
        flow.sent += 10**9
        meter.update([flow], _ctx(now, link_bandwidth={"victim:tx": capacity}))
        loads = [meter.load_above("victim:tx", level) for level in range(8)]
        assert all(math.isfinite(load) and load >= 0 for load in loads)
        assert math.isfinite(meter.others_load(flow, ctx))
        assert math.isfinite(meter.flow_rate(flow))
    # the capacity restored: the meter measures again
    meter.update([flow], _ctx(3.0, link_bandwidth={"victim:tx": 1e9}))
    flow.sent += 10**8
    meter.update([flow], _ctx(3.1, link_bandwidth={"victim:tx": 1e9}))
    assert 0 < meter.link_load("victim:tx") < 2


def _known(meter: TrafficMeter) -> set[str]:
    """Link names the meter holds anything for."""
    return {link for link, _ in meter._tallies} | set(meter._link_util)


def test_the_meter_forgets_links_no_open_flow_uses() -> None:
    window = 0.05
    meter = TrafficMeter(window)
    idle_open = build_flow(1, "kv", size=10**12, links=("open:tx", "shared:rx"))
    busy = build_flow(2, "kv", size=10**12, links=("busy:tx", "shared:rx"))
    closed = [
        build_flow(10 + i, "kv", size=10**12, links=(f"n{i}:tx", f"n{i}:rx")) for i in range(50)
    ]
    everyone = [idle_open, busy, *closed]
    for flow in everyone:
        flow.level = 4
        meter.open(flow, 0.0)
    for flow in everyone:
        flow.sent += 10**6
    meter.update(everyone, _ctx(0.01))
    for flow in closed:
        meter.close(flow)
    meter.update([idle_open, busy], _ctx(0.02))
    assert len(_known(meter)) == 3 + 100
    now, step = 0.02, PRUNE_WINDOWS * window / 8
    while now < 2.5 * PRUNE_WINDOWS * window:
        now += step
        busy.sent += 10**6
        meter.update([idle_open, busy], _ctx(now))
    # kept: the links of open flows, busy or idle; forgotten: the closed flows' links
    assert _known(meter) == {"open:tx", "shared:rx", "busy:tx"}
    assert meter.load_above("open:tx", 8) < 1e-80  # (what it held had decayed to nothing)
    assert meter.link_load("busy:tx") > 0


def test_pruning_changes_no_load_a_policy_reads() -> None:
    """Two meters, one pruning every update, one never: the loads on every link agree exactly
    (a pruned entry had decayed by exp(-PRUNE_WINDOWS), nothing next to a live one)."""
    window = 0.05
    pruning, keeping = TrafficMeter(window), TrafficMeter(window)
    keeping._next_prune = math.inf
    flows = [
        build_flow(i + 1, "kv", size=10**12, links=(f"n{i % 5}:tx", "d:rx")) for i in range(20)
    ]
    now = 0.0
    for meter in (pruning, keeping):
        for flow in flows:
            flow.level = flow.flow_id % 3
            meter.open(flow, now)
    sent = {flow.flow_id: 0 for flow in flows}
    for tick in range(1, 600):
        now = tick * 0.05
        live = [flow for flow in flows if (flow.flow_id + tick // 100) % 4]  # churn in phases
        for flow in live:
            sent[flow.flow_id] += 10**6 * flow.flow_id
            flow.sent = sent[flow.flow_id]
        pruning.update(live, _ctx(now))
        keeping.update(live, _ctx(now))
        pruning._next_prune = -math.inf  # prune at every update
        for link in ("n0:tx", "n1:tx", "n2:tx", "n3:tx", "n4:tx", "d:rx"):
            for level in range(4):
                assert pruning.load_above(link, level) == pytest.approx(
                    keeping.load_above(link, level), rel=0, abs=1e-60
                )


@pytest.mark.parametrize("rho_source", ["above", "others", "link"])
@pytest.mark.parametrize("deferred_order", ["mlu", "deadline"])
def test_rmlq_recovers_from_a_denormal_capacity_once_the_real_one_is_back(
    rho_source: str, deferred_order: str
) -> None:
    """docs/security.md's H2: a collective on a link reported at 5e-324 B/s, then a deadline
    flow on it, and the real capacity reported again: rho and every timer stay finite."""
    policy = create("rmlq", {"rho_source": rho_source, "deferred_order": deferred_order},
                    num_levels=8)  # fmt: skip
    assert isinstance(policy, rmlq.RmlqPolicy)
    tp = build_flow(1, "tp", size=10**12, links=("victim:tx",))
    sync = build_flow(2, "param_sync", size=10**3, deadline=30.0, links=("victim:tx",))
    for tick in range(8):
        capacity = 5e-324 if tick < 4 else 1e9
        ctx = _ctx(tick * 0.01, link_bandwidth={"victim:tx": capacity})
        if tick == 0:
            tp.level = policy.admit(tp, ctx).level
        if tick == 3:
            sync.level = policy.admit(sync, ctx).level
        active = [tp] if tick < 3 else [tp, sync]
        tp.sent += 10**8
        for fid, decision in policy.reevaluate(active, ctx).items():
            (tp if fid == 1 else sync).level = decision.level
        for flow in active:
            when = policy.next_change(flow, ctx)
            assert when is None or (math.isfinite(when) and when > ctx.now)
    assert 0.0 <= policy._rho(sync, ctx) < 1.0
