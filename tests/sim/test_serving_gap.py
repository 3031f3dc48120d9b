"""bench/serving_gap.py's simulator: deadline flows start late (or at a provisional level),
collectives carry more bytes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest
from bench_script_loader import load_bench_script

from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies import create
from flowsched.sim.engine import SimConfig

gap = load_bench_script("serving_gap.py")


@pytest.mark.parametrize(
    ("cls", "delay", "scale", "finished"),
    [
        (FlowClass.KV, 0.0, 1.0, 1.0),
        (FlowClass.KV, 0.25, 3.0, 1.25),  # delayed, not scaled
        (FlowClass.KV_REUSE, 0.5, 1.0, 1.5),
        (FlowClass.TP, 0.25, 3.0, 3.0),  # scaled, not delayed
        (FlowClass.TP, 0.0, 1.5, 1.5),
    ],
)
def test_overheads_apply_to_their_classes_only(
    cls: FlowClass, delay: float, scale: float, finished: float
) -> None:
    sim = gap.OverheadSimulator(
        {"l": 100.0},
        create("fair"),
        SimConfig(chunk_bytes=0, timer_period=0),
        open_delay=delay,
        collective_scale=scale,
    )
    done: list[float] = []

    def on_done(flow: Flow) -> None:
        done.append(sim.now)

    sim.open_flow(cls, 100, ("l",), on_done)
    sim.run()
    assert done == [pytest.approx(finished)]
    (record,) = sim.records.flows
    assert record.opened == pytest.approx(delay if cls != FlowClass.TP else 0.0)


@pytest.mark.parametrize(("provisional", "held"), [(6, 6), (-1, None)])
def test_a_provisional_level_sends_at_once_and_takes_the_policys_after_the_delay(
    provisional: int, held: int | None
) -> None:
    policy = create("static")
    sim = gap.OverheadSimulator(
        {"l": 100.0},
        policy,
        SimConfig(chunk_bytes=0, timer_period=0),
        open_delay=0.25,
        collective_scale=1.0,
        provisional_level=provisional,
    )
    flow = sim.open_flow(FlowClass.KV, 1000, ("l",))
    admitted = policy.admit(flow, sim._context()).level  # static: the class's level
    assert admitted != 6
    sim.run(until=0.1)
    assert sim.active[flow.flow_id].level == (admitted if held is None else held)
    assert sim.active[flow.flow_id].rate == 100.0  # sending meanwhile, at the link's rate
    sim.run(until=0.3)
    assert sim.active[flow.flow_id].level == admitted


class _PromoteOnFirstLook:
    """Level 6 at admission, level 1 from the first re-evaluation on."""

    name = "promote-on-first-look"
    num_levels = 8

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return Decision(6)

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return {f.flow_id: Decision(1) for f in flows if f.level != 1}

    def release(self, flow: Flow, ctx: Context) -> None:
        pass


def test_a_decision_delay_applies_each_later_decision_that_much_later() -> None:
    sim = gap.OverheadSimulator(
        {"l": 100.0},
        _PromoteOnFirstLook(),
        SimConfig(chunk_bytes=0, timer_period=0.05),
        open_delay=0.0,
        collective_scale=1.0,
        decision_delay=0.1,
    )
    flow = sim.open_flow(FlowClass.KV, 10**6, ("l",))
    sim.run(until=0.01)
    assert sim.active[flow.flow_id].level == 6  # admitted at once, at the policy's level
    # decided when it opened (a rank policy sees every flow then), repeated at the ticks at
    # 0.05 and 0.1 (the flow is still at 6): the first decision arrives at 0.1, once
    sim.run(until=0.09)
    assert sim.active[flow.flow_id].level == 6
    sim.run(until=0.11)
    assert sim.active[flow.flow_id].level == 1
    assert not sim._in_flight
