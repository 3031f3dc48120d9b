"""The simulator applies rmlq's pruning: decisions for flows not passed, late flows."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import pytest

from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies import create
from flowsched.policies.rmlq import RmlqPolicy
from flowsched.sim.engine import SimConfig, Simulator


class SpyRmlq:
    """The rmlq it wraps, recording which flows each ``reevaluate`` was passed (a wrapper:
    the compiled RmlqPolicy cannot be subclassed by Python code)."""

    def __init__(self, inner: RmlqPolicy) -> None:
        self._inner = inner
        self.passed: list[set[int]] = []

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        active = list(flows)
        self.passed.append({flow.flow_id for flow in active})
        return self._inner.reevaluate(active, ctx)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_pruned_request_flows_not_passed_move_to_the_scavenger_at_once() -> None:
    """On link l (1e9 B/s) r1 needs 0.5 s by 1.0; r2's flow opened at 0.1 needs 0.9 s by 1.2:
    infeasible together. r1's job reports progress at 0.2: only r1's flow is passed, Algorithm
    1 prunes r2, and both of r2's flows (one alone on link m) drop to level 7 at 0.2."""
    base = create("rmlq", {}, num_levels=8)
    assert isinstance(base, RmlqPolicy)
    policy = SpyRmlq(base)
    sim = Simulator({"l": 1e9, "m": 1e9}, policy, SimConfig(chunk_bytes=0))  # type: ignore[arg-type]
    assert sim._per_flow
    opened: dict[str, int] = {}
    seen: dict[int, int] = {}

    def open_flow(name: str, size: float, deadline: float, request: str, link: str) -> None:
        flow = sim.open_flow(FlowClass.KV, int(size), (link,), deadline=deadline,
                             request=request, job=f"job-{name}")  # fmt: skip
        opened[name] = flow.flow_id

    sim.at(0.0, lambda: open_flow("r1", 5e8, 1.0, "r1", "l"))
    sim.at(0.0, lambda: open_flow("r2-small", 5e8, 5.0, "r2", "m"))
    sim.at(0.1, lambda: open_flow("r2-big", 9e8, 1.2, "r2", "l"))
    sim.at(0.2, lambda: sim.set_job_index("job-r1", 0))

    def check() -> None:
        seen.update({fid: state.level for fid, state in sim.active.items()})

    sim.at(0.2000001, check)
    sim.run(until=0.3)
    touched = [ids for ids in policy.passed if opened["r1"] in ids]
    assert touched and opened["r2-small"] not in touched[0]
    assert seen[opened["r2-small"]] == 7 and seen[opened["r2-big"]] == 7
    assert seen[opened["r1"]] < 7


class SizeBlindRmlq:
    """The rmlq it wraps, seeing every flow without its size (as an SDK flow opened without
    one reaches the coordinator) while the engine moves the flow's bytes: the policy gets a
    copy of each flow with ``size=None``, its ``sent`` and ``level`` kept in step."""

    def __init__(self, inner: RmlqPolicy) -> None:
        self._inner = inner
        self._views: dict[int, Flow] = {}

    def _view(self, flow: Flow) -> Flow:
        view = self._views.get(flow.flow_id)
        if view is None:
            view = self._views[flow.flow_id] = dataclasses.replace(flow, size=None)
        view.sent, view.level = flow.sent, flow.level
        return view

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self._inner.admit(self._view(flow), ctx)

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return self._inner.reevaluate([self._view(flow) for flow in flows], ctx)

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        return self._inner.next_change(self._view(flow), ctx)

    def release(self, flow: Flow, ctx: Context) -> None:
        self._inner.release(self._view(flow), ctx)
        del self._views[flow.flow_id]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@pytest.mark.parametrize("promotion", ["timers", "sweep"])
def test_a_late_kv_flow_of_unknown_size_goes_to_the_scavenger_at_its_deadline(
    promotion: str,
) -> None:
    """A kv flow whose size the policy does not know (deadline 0.5 s; 10 s of bytes on its
    link), nothing else happening: at unknown_level until its deadline, on the scavenger
    level just after it, with promotion timers as with the sweep (timers: it stayed there)."""
    base = create("rmlq", {}, num_levels=8)
    assert isinstance(base, RmlqPolicy)
    sim = Simulator({"l": 1e9}, SizeBlindRmlq(base), SimConfig(promotion=promotion))  # type: ignore[arg-type]
    opened: list[Flow] = []
    seen: dict[float, int] = {}

    def look(when: float) -> None:
        seen[when] = sim.active[opened[0].flow_id].level

    sim.at(0.0, lambda: opened.append(sim.open_flow(FlowClass.KV, 10**10, ("l",), deadline=0.5)))
    for when in (0.25, 0.499, 0.502):
        sim.at(when, lambda when=when: look(when))
    sim.run(until=0.6)
    assert seen == {0.25: base.unknown_level, 0.499: base.unknown_level, 0.502: 7}
