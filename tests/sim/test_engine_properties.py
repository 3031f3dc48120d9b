"""Hypothesis properties of the engine: bytes conserved, no link above its capacity and work
conservation at every event, levels in range, and no level change inside a message."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.sim.engine import ActiveFlow, SimConfig, Simulator

LINKS = {"a": 100.0, "b": 60.0, "c": 150.0, "d": 40.0}
K = 4
CHUNK = 16


class ShufflingPolicy:
    """Random (seeded) levels and caps, re-drawn at every re-evaluation: a hostile policy."""

    name = "shuffle"

    def __init__(self, seed: int) -> None:
        self.num_levels = K
        self.rng = random.Random(seed)

    def _draw(self) -> Decision:
        cap = self.rng.choice([None, None, None, 10.0, 35.0])
        return Decision(self.rng.randrange(K), cap)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self._draw()

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return {f.flow_id: self._draw() for f in flows if self.rng.random() < 0.3}

    def release(self, flow: Flow, ctx: Context) -> None:
        return None


flow_spec = st.tuples(
    st.floats(0.0, 3.0),
    st.integers(1, 400),
    st.lists(st.sampled_from(sorted(LINKS)), min_size=1, max_size=3, unique=True),
)


class Checker:
    """Observes every rate recomputation: integrates rates and checks work conservation."""

    def __init__(self) -> None:
        self.delivered: dict[int, float] = {}
        self.rates: dict[int, float] = {}
        self.t = 0.0
        self.states: dict[int, ActiveFlow] = {}
        self.violations: list[str] = []

    def __call__(self, sim: Simulator) -> None:
        for flow_id, rate in self.rates.items():
            self.delivered[flow_id] = self.delivered.get(flow_id, 0.0) + rate * (sim.now - self.t)
        self.t = sim.now
        self.rates = {fid: s.rate for fid, s in sim.active.items()}
        self.states.update(sim.active)
        self._check_capacity(sim)
        for state in sim.active.values():
            self._check_work_conserving(sim, state)

    def _check_capacity(self, sim: Simulator) -> None:
        """The flows' own rates (not the engine's cached link totals) fit every link."""
        used: dict[int, float] = {}
        for state in sim.active.values():
            for link in state.links:
                used[link] = used.get(link, 0.0) + state.rate
        for link, rate in used.items():
            if rate > sim.capacity[link] * (1 + 1e-9) + 1e-9:
                self.violations.append(
                    f"t={sim.now} link {sim.link_names[link]} at {rate / sim.capacity[link]:.3%}"
                )

    def _check_work_conserving(self, sim: Simulator, state: ActiveFlow) -> None:
        if state.remaining <= 1e-9 or (state.cap is not None and state.rate >= state.cap - 1e-9):
            return
        names = [sim.link_names[link] for link in state.links]
        if not any(sim.link_utilization(name) >= 1 - 1e-9 for name in names):
            self.violations.append(
                f"t={sim.now} flow {state.flow.flow_id} on {names} not bottlenecked"
            )


def _simulate(
    flows: list[tuple[float, int, list[str]]], seed: int, chunk: int
) -> tuple[Simulator, Checker]:
    sim = Simulator(
        LINKS,
        ShufflingPolicy(seed),
        SimConfig(chunk_bytes=chunk, timer_period=0.05),
        record_changes=True,
    )
    checker = Checker()
    sim.observer = checker
    for start, size, links in flows:
        sim.at(start, lambda s=size, p=tuple(links): sim.open_flow(FlowClass.BULK, s, p))
    sim.run()
    checker(sim)
    return sim, checker


@settings(max_examples=60, deadline=None)
@given(st.lists(flow_spec, min_size=1, max_size=12), st.integers(0, 10_000))
def test_bytes_conserved_and_work_conserving(flows: list, seed: int) -> None:
    sim, checker = _simulate(flows, seed, CHUNK)
    assert len(sim.records.flows) == len(flows), "every flow finishes"
    assert not checker.violations, checker.violations[:3]
    for record in sim.records.flows:
        delivered = checker.delivered.get(record.flow_id, 0.0)
        assert abs(delivered - record.size) <= 1e-6 * record.size + 1e-6, (record, delivered)
        assert 0 <= record.first_level < K and 0 <= record.last_level < K


@settings(max_examples=60, deadline=None)
@given(st.lists(flow_spec, min_size=1, max_size=12), st.integers(0, 10_000))
def test_level_changes_only_at_message_boundaries(flows: list, seed: int) -> None:
    _, checker = _simulate(flows, seed, CHUNK)
    for state in checker.states.values():
        for offset in state.changes_at:
            nearest = round(offset / CHUNK) * CHUNK
            # the engine's rounding tolerance is 1e-3 byte (_BYTE_EPS): far below one byte
            assert abs(offset - nearest) <= 1e-3, (state.flow.flow_id, offset)


@settings(max_examples=30, deadline=None)
@given(st.lists(flow_spec, min_size=1, max_size=12), st.integers(0, 10_000))
def test_incremental_allocation_matches_full_recomputation(flows: list, seed: int) -> None:
    """Component-limited recomputation gives the same rates as recomputing everything."""
    from flowsched.sim.allocate import allocate_levels

    sim = Simulator(LINKS, ShufflingPolicy(seed), SimConfig(chunk_bytes=0, timer_period=0.05))
    mismatches: list[str] = []

    def full(sim: Simulator) -> None:
        states = list(sim.active.values())
        saved = [s.rate for s in states]
        allocate_levels(states, [s.level for s in states], dict(enumerate(sim.capacity)))
        for state, rate in zip(states, saved, strict=True):
            if abs(state.rate - rate) > 1e-6 * max(rate, 1.0):
                mismatches.append(f"t={sim.now} flow {state.flow.flow_id}: {rate} vs {state.rate}")
            state.rate = rate

    sim.observer = full
    for start, size, links in flows:
        sim.at(start, lambda s=size, p=tuple(links): sim.open_flow(FlowClass.BULK, s, p))
    sim.run()
    assert not mismatches, mismatches[:3]


def test_the_checker_catches_an_over_booking_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capacity check must fail an allocator that gives every flow the whole link."""
    import flowsched.sim.engine as engine

    def over_book(flows: Iterable[ActiveFlow], levels: Iterable[int], residual: dict) -> None:
        for state in flows:
            state.rate = min(residual[link] for link in state.links)

    monkeypatch.setattr(engine, "allocate_levels", over_book)
    _, checker = _simulate([(0.0, 100, ["a"]), (0.0, 100, ["a", "b"])], seed=1, chunk=0)
    assert any("link a at" in v for v in checker.violations), checker.violations


def _bottleneck_violations(sim: Simulator) -> list[str]:
    """Flows below their cap with no link where they are a top rate of their queue and the
    queues up to theirs fill the link (max-min per queue, strict priority between queues)."""
    out = []
    states = list(sim.active.values())
    for s in states:
        if s.cap is not None and s.rate >= s.cap - 1e-9:
            continue
        ok = False
        for link in s.links:
            on = [o for o in states if link in o.links]
            used = sum(o.rate for o in on if o.queue <= s.queue)
            same = max(o.rate for o in on if o.queue == s.queue)
            if used >= sim.capacity[link] * (1 - 1e-9) - 1e-9 and s.rate >= same - 1e-9:
                ok = True
        if not ok:
            out.append(f"t={sim.now} flow {s.flow.flow_id} q{s.queue} rate {s.rate}")
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(flow_spec, min_size=1, max_size=12),
    st.integers(0, 10_000),
    st.lists(st.integers(0, K - 1), min_size=K, max_size=K).map(lambda q: tuple(sorted(q))),
    st.booleans(),
)
def test_max_min_per_queue(flows: list, seed: int, queues: tuple, private: bool) -> None:
    """With levels compressed into hardware queues (and private paths for the ideal bound)."""
    cfg = SimConfig(
        chunk_bytes=16,
        timer_period=0.05,
        level_queue=queues,
        private_classes=frozenset({FlowClass.KV}) if private else frozenset(),
    )
    sim = Simulator(LINKS, ShufflingPolicy(seed), cfg)
    bad: list[str] = []
    sim.observer = lambda s: bad.extend(_bottleneck_violations(s))
    for i, (start, size, links) in enumerate(flows):
        cls = FlowClass.KV if i % 2 else FlowClass.BULK
        sim.at(start, lambda s=size, p=tuple(links), c=cls: sim.open_flow(c, s, p))
    sim.run()
    assert len(sim.records.flows) == len(flows)
    assert not bad, bad[:3]
