"""The fluid engine against closed-form finish times (one and two links)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest

from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies import create
from flowsched.sim.allocate import waterfill
from flowsched.sim.engine import SimConfig, Simulator
from flowsched.sim.topology import NodeGroup, Topology


class FixedPolicy:
    """Test policy: level = ``consumer_index``, optional cap per flow id, and per flow id a
    schedule of ``(from time, level)`` steps (promotions, and demotions back)."""

    name = "fixed"

    def __init__(
        self,
        num_levels: int = 4,
        caps: Mapping[int, float] | None = None,
        promote: Mapping[int, list[tuple[float, int]]] | None = None,
    ) -> None:
        self.num_levels = num_levels
        self.caps = dict(caps or {})
        self.promote = dict(promote or {})

    def _decision(self, flow: Flow, now: float) -> Decision:
        level = flow.consumer_index or 0
        for start, scheduled in self.promote.get(flow.flow_id, []):
            if now >= start:
                level = scheduled
        return Decision(level, self.caps.get(flow.flow_id))

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self._decision(flow, ctx.now)

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        out = {}
        for flow in flows:
            decision = self._decision(flow, ctx.now)
            if decision.level != flow.level:
                out[flow.flow_id] = decision
        return out

    def release(self, flow: Flow, ctx: Context) -> None:
        return None


def _finish_times(sim: Simulator) -> dict[int, float]:
    sim.run()
    return {r.flow_id: round(r.finished, 9) for r in sim.records.flows}


def _open(sim: Simulator, at: float, size: int, links: tuple[str, ...], level: int = 0) -> None:
    sim.at(at, lambda: sim.open_flow(FlowClass.BULK, size, links, consumer_index=level))


# (name, capacities, flows as (start, size, links, level), expected finish per flow id)
CASES = [
    ("fair-equal", {"l": 100.0}, [(0, 100, ("l",), 0), (0, 100, ("l",), 0)], {1: 2.0, 2: 2.0}),
    ("fair-short-first", {"l": 100.0}, [(0, 100, ("l",), 0), (0, 50, ("l",), 0)], {1: 1.5, 2: 1.0}),
    (
        "fair-late-arrival",
        {"l": 100.0},
        [(0, 100, ("l",), 0), (0.5, 100, ("l",), 0)],
        {1: 1.5, 2: 2.0},
    ),
    (
        "fair-three",
        {"l": 90.0},
        [(0, 30, ("l",), 0), (0, 60, ("l",), 0), (0, 90, ("l",), 0)],
        {1: 1.0, 2: 5 / 3, 3: 2.0},
    ),
    ("priority", {"l": 100.0}, [(0, 100, ("l",), 1), (0, 100, ("l",), 0)], {1: 2.0, 2: 1.0}),
    (
        "priority-preempts",
        {"l": 100.0},
        [(0, 100, ("l",), 1), (0.5, 25, ("l",), 0)],
        {1: 1.25, 2: 0.75},
    ),
    (
        "fifo-by-level",
        {"l": 100.0},
        [(0, 100, ("l",), 0), (0.5, 100, ("l",), 1), (0.7, 100, ("l",), 2)],
        {1: 1.0, 2: 2.0, 3: 3.0},
    ),
    # max-min differs from an equal split of x: flow 1 is held to 30 by y, flow 2 gets 70
    (
        "two-link-maxmin",
        {"x": 100.0, "y": 30.0},
        [(0, 30, ("x", "y"), 0), (0, 70, ("x",), 0)],
        {1: 1.0, 2: 1.0},
    ),
    (
        "two-link-three-flows",
        {"x": 100.0, "y": 30.0},
        [(0, 15, ("x", "y"), 0), (0, 85, ("x",), 0), (0, 15, ("y",), 0)],
        {1: 1.0, 2: 1.0, 3: 1.0},
    ),
    (
        "priority-leftover-on-other-link",
        {"x": 100.0, "y": 100.0},
        [(0, 60, ("x",), 0), (0, 40, ("x", "y"), 1), (0, 60, ("y",), 1)],
        {1: 0.6, 2: 1.0, 3: 0.6},
    ),
]


@pytest.mark.parametrize(
    ("capacity", "flows", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_closed_form_finish_times(capacity: dict[str, float], flows: list, expected: dict) -> None:
    sim = Simulator(capacity, FixedPolicy(), SimConfig(chunk_bytes=0, timer_period=0))
    for start, size, links, level in flows:
        _open(sim, start, size, links, level)
    assert _finish_times(sim) == pytest.approx(expected)


def test_fair_policy_matches_max_min() -> None:
    sim = Simulator({"l": 100.0}, create("fair"), SimConfig(chunk_bytes=0))
    _open(sim, 0, 100, ("l",))
    _open(sim, 0, 50, ("l",))
    assert _finish_times(sim) == pytest.approx({1: 1.5, 2: 1.0})


def test_rate_cap_leaves_the_rest_to_others() -> None:
    sim = Simulator(
        {"l": 100.0}, FixedPolicy(caps={1: 20.0}), SimConfig(chunk_bytes=0, timer_period=0)
    )
    _open(sim, 0, 20, ("l",))
    _open(sim, 0, 100, ("l",))
    # flow 1 at 20 B/s ends at 1.0; flow 2 gets 80 then 100 B/s: 80 + 20 -> 1.2
    assert _finish_times(sim) == pytest.approx({1: 1.0, 2: 1.2})


@pytest.mark.parametrize(
    ("chunk", "expected_first"), [(0, 1.25), (40, 1.4)], ids=["fluid", "chunk-40"]
)
def test_level_change_waits_for_message_boundary(chunk: int, expected_first: float) -> None:
    # both fair at 50 B/s; at t=0.5 (timer) flow 1 (25 B sent) is promoted to level 0. With
    # 40-byte messages the change applies at 40 B sent (t=0.8), then 60 B at 100 B/s -> 1.4.
    policy = FixedPolicy(promote={1: [(0.5, 0)]})
    sim = Simulator({"l": 100.0}, policy, SimConfig(chunk_bytes=chunk, timer_period=0.5))
    _open(sim, 0, 100, ("l",), 1)
    _open(sim, 0, 100, ("l",), 1)
    assert _finish_times(sim) == pytest.approx({1: expected_first, 2: 2.0})


def test_policy_level_out_of_range_is_an_error() -> None:
    sim = Simulator({"l": 100.0}, FixedPolicy(num_levels=2), SimConfig(timer_period=0))
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        sim.open_flow(FlowClass.BULK, 10, ("l",), consumer_index=5)


def test_link_less_flow_completes_at_once_and_calls_back() -> None:
    sim = Simulator({"l": 100.0}, FixedPolicy(), SimConfig(timer_period=0))
    done: list[float] = []
    sim.at(0.3, lambda: sim.open_flow(FlowClass.TP, 10, (), lambda f: done.append(sim.now)))
    sim.run()
    assert done == [0.3]


def test_link_load_is_an_ewma_of_utilization() -> None:
    sim = Simulator({"l": 100.0}, FixedPolicy(), SimConfig(timer_period=0, load_tau=0.1))
    _open(sim, 0, 1000, ("l",))
    seen: list[float] = []
    sim.at(0.1, lambda: seen.append(sim.link_load("l")))
    sim.at(1.0, lambda: seen.append(sim.link_load("l")))
    sim.run()
    assert seen[0] == pytest.approx(1 - 2.718281828**-1, rel=1e-6)
    assert seen[1] == pytest.approx(1.0, abs=1e-4)


def test_waterfill_caps_and_bottlenecks() -> None:
    class F:
        def __init__(self, links: tuple[int, ...], cap: float | None = None) -> None:
            self.links, self.cap, self.rate = links, cap, 0.0

    flows = [F((0, 1)), F((0,)), F((0,), cap=5.0)]
    residual = {0: 100.0, 1: 30.0}
    waterfill(flows, residual)
    assert [f.rate for f in flows] == pytest.approx([30.0, 65.0, 5.0])
    assert residual == pytest.approx({0: 0.0, 1: 0.0})


def test_oversubscribed_uplink_is_shared_by_the_node_nics() -> None:
    topo = Topology.build([NodeGroup("n", 2, nics=2, nic_gbps=8.0)], oversubscription=2.0)
    assert topo.path("n0", 1, "n1", 0) == ("n0.nic1.tx", "n0.up", "n1.down", "n1.nic0.rx")
    assert topo.capacity["n0.up"] == pytest.approx(1e9)  # 2 NICs x 1 GB/s / 2
    assert topo.path("n0", 0, "n0", 1) == ()
    sim = Simulator(topo.capacity, FixedPolicy(), SimConfig(chunk_bytes=0, timer_period=0))
    # two flows from different NICs of n0 share its 1 GB/s uplink: 0.5 GB/s each
    _open(sim, 0, 10**9, topo.path("n0", 0, "n1", 0))
    _open(sim, 0, 10**9, topo.path("n0", 1, "n1", 1))
    assert _finish_times(sim) == pytest.approx({1: 2.0, 2: 2.0})


def test_levels_sharing_a_hardware_queue_share_it_fairly() -> None:
    """Levels 1 and 2 compressed into one queue share the link max-min, as a switch would;
    level 0 keeps its own queue and strict priority over them."""
    config = SimConfig(chunk_bytes=0, timer_period=0.0, level_queue=(0, 1, 1, 2))
    sim = Simulator({"a": 100.0}, FixedPolicy(), config)
    _open(sim, 0.0, 100, ("a",), level=1)
    _open(sim, 0.0, 100, ("a",), level=2)
    _open(sim, 0.0, 50, ("a",), level=0)
    finish = _finish_times(sim)
    assert finish == {3: 0.5, 1: 2.5, 2: 2.5}
    levels = {r.flow_id: r.last_level for r in sim.records.flows}
    assert levels == {1: 1, 2: 2, 3: 0}, "records keep the policy's levels"


def test_private_classes_get_a_full_rate_link_of_their_own() -> None:
    """The ideal-network bound: KV flows each get the bottleneck rate of their path and leave
    the shared links to the collectives."""
    config = SimConfig(chunk_bytes=0, timer_period=0.0, private_classes=frozenset({FlowClass.KV}))
    sim = Simulator({"a": 100.0, "b": 50.0}, FixedPolicy(), config)
    for _ in range(3):
        sim.at(0.0, lambda: sim.open_flow(FlowClass.KV, 100, ("a", "b"), consumer_index=3))
    sim.at(0.0, lambda: sim.open_flow(FlowClass.TP, 100, ("a",), consumer_index=3))
    finish = _finish_times(sim)
    assert finish == {1: 2.0, 2: 2.0, 3: 2.0, 4: 1.0}


class BandwidthSeen(FixedPolicy):
    """FixedPolicy that keeps the link bandwidth each admission saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, float]] = []

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        self.seen.append(dict(ctx.link_bandwidth))
        return super().admit(flow, ctx)


def test_payload_share_slows_the_flows_not_the_rate_policies_see() -> None:
    """Headers take 1 - share of every link, private paths included; policies see the
    nominal rate, as the agents are told it."""
    config = SimConfig(
        chunk_bytes=0,
        timer_period=0.0,
        private_classes=frozenset({FlowClass.KV}),
        payload_share=0.8,
    )
    policy = BandwidthSeen()
    sim = Simulator({"a": 100.0, "b": 50.0}, policy, config)
    sim.at(0.0, lambda: sim.open_flow(FlowClass.TP, 80, ("a",), consumer_index=1))
    sim.at(0.0, lambda: sim.open_flow(FlowClass.KV, 40, ("a", "b"), consumer_index=1))
    assert _finish_times(sim) == pytest.approx({1: 1.0, 2: 1.0})
    assert policy.seen[0] == {"a": 100.0, "b": 50.0}
    assert policy.seen[1]["private2"] == 50.0


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_payload_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="payload_share"):
        Simulator({"a": 1.0}, FixedPolicy(), SimConfig(payload_share=share))


class TimedPolicy(FixedPolicy):
    """Per-flow decisions with promotion timers: flow ``i`` moves to level 0 at ``i * 0.1`` s."""

    per_flow_decisions = True

    def __init__(self, promote: Mapping[int, list[tuple[float, int]]] | None = None) -> None:
        super().__init__(promote={1: [(0.1, 0)], 2: [(0.2, 0)]} if promote is None else promote)
        self.seen: list[tuple[float, list[int]]] = []

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        flows = list(flows)
        self.seen.append((ctx.now, sorted(f.flow_id for f in flows)))
        return super().reevaluate(flows, ctx)

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        starts = (start for start, _ in self.promote.get(flow.flow_id, []) if start > ctx.now)
        when = next(starts, None)
        return when if when is not None and flow.level != 0 else None


def test_promotion_timers_replace_the_sweep_and_touch_only_their_flow() -> None:
    """A policy with next_change is re-evaluated when a flow's time comes (no periodic sweep),
    and a per-flow policy sees only the flows an event touched."""
    policy = TimedPolicy()
    sim = Simulator({"a": 100.0, "b": 100.0}, policy, SimConfig(chunk_bytes=0, timer_period=1e-3))
    _open(sim, 0.0, 100, ("a",), level=2)
    _open(sim, 0.0, 100, ("b",), level=2)
    sim.run()
    timed = [(round(t, 9), ids) for t, ids in policy.seen if ids]
    assert (0.1, [1]) in timed and (0.2, [2]) in timed
    assert len(policy.seen) <= 4, "no 1 ms sweep: only the two timers (and completions)"
    assert all(len(ids) <= 1 for _, ids in policy.seen)


def test_a_promotion_due_while_a_decision_waits_for_its_boundary_is_not_lost() -> None:
    """Flows 1 and 2 share a 100 B/s link at level 2 (40-byte messages). Flow 1 is promoted to
    level 1 at 0.5 (25 B sent: applies at 40 B, t=0.8) and is due for level 0 at 0.7. Its timer
    runs while the first decision waits, as the coordinator's does (it holds what it sent), so
    the boundary at 0.8 applies level 0, and flow 3 (level 1, at 0.9) waits behind it: 1 ends at
    1.4, 3 at 1.7, 2 at 2.3. Without that timer the boundary applied level 1, and the promotion
    to 0 never came: 1 shared with 3 and ended at 1.7, 3 at 1.5."""
    policy = TimedPolicy(promote={1: [(0.5, 1), (0.7, 0)]})
    sim = Simulator({"l": 100.0}, policy, SimConfig(chunk_bytes=40, timer_period=1e-3))
    _open(sim, 0, 100, ("l",), 2)
    _open(sim, 0, 100, ("l",), 2)
    _open(sim, 0.9, 30, ("l",), 1)
    assert _finish_times(sim) == pytest.approx({1: 1.4, 2: 2.3, 3: 1.7})
    assert (0.7, [1]) in [(round(t, 9), ids) for t, ids in policy.seen]


class NamingPolicy(TimedPolicy):
    """A per-flow policy whose released_affects answers ``named``."""

    def __init__(self, named: tuple[int, ...] | None) -> None:
        super().__init__(promote={})
        self.named = named

    def released_affects(self, flow: Flow) -> tuple[int, ...] | None:
        return self.named


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (TimedPolicy(promote={}), [2]),
        (NamingPolicy(None), [2]),
        (NamingPolicy(()), []),
        (NamingPolicy((3, 99)), [3]),
    ],
    ids=["no-hook", "hook-answers-none", "hook-names-none", "hook-names-another-job"],
)
def test_a_close_re_evaluates_what_released_affects_names(
    policy: TimedPolicy, expected: list[int]
) -> None:
    """As the coordinator: a close re-evaluates the open flows the per-flow policy's
    ``released_affects`` names (99 is not open), else the rest of the closed flow's job."""
    sim = Simulator({"a": 100.0, "b": 100.0, "c": 100.0}, policy, SimConfig(chunk_bytes=0))
    sim.open_flow(FlowClass.BULK, 10, ("a",), job="j")
    sim.open_flow(FlowClass.BULK, 100, ("b",), job="j")
    sim.open_flow(FlowClass.BULK, 100, ("c",))
    sim.run()
    assert [ids for t, ids in policy.seen if round(t, 9) == 0.1] == [expected]


class PastDuePolicy(TimedPolicy):
    """A next_change that keeps answering a time already past (e.g. a passed deadline)."""

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        return 0.0


def test_a_promotion_time_in_the_past_waits_for_the_next_tick() -> None:
    policy = PastDuePolicy()
    sim = Simulator({"a": 100.0}, policy, SimConfig(chunk_bytes=0, timer_period=0.01))
    _open(sim, 0.0, 100, ("a",), level=2)
    sim.run()
    # 1 s of transfer: one re-evaluation per 10 ms tick at most, not one per microsecond
    assert 50 <= len(policy.seen) <= 110


class BoundedSimulator(Simulator):
    """Fails instead of spinning: at most ``limit`` events."""

    limit = 10_000

    def _dispatch(self, kind: int, payload: object, version: int) -> None:
        assert self.events_processed <= self.limit, f"event {self.events_processed} at {self.now}"
        super()._dispatch(kind, payload, version)


@pytest.mark.parametrize("period", [1e-300, 5e-324, 1e-15], ids=["1e-300", "denormal", "1e-15"])
def test_a_sweep_period_below_a_microsecond_still_moves_the_clock(period: float) -> None:
    """A policy file's timer_period is any number in (0, 60] (a scenario's timer_ms any >= 0):
    with 1e-300 the sweep re-armed at now + 1e-300 == now, an endless loop at one instant
    (``flowsched sim --policy-file`` hung). The sweep waits at least 1 us, as timers do."""
    policy = FixedPolicy(num_levels=1)
    sim = BoundedSimulator({"a": 1e9}, policy, SimConfig(chunk_bytes=0, timer_period=period))
    sim.at(0.5, lambda: sim.open_flow(FlowClass.BULK, 10**6, ("a",)))
    sim.run()
    assert sim.records.flows[0].finished == pytest.approx(0.501)


@pytest.mark.parametrize("promotion", ["timers", "sweep"])
def test_a_later_flow_of_a_request_brings_its_siblings_promotion_forward(promotion: str) -> None:
    """rmlq with request-scope MLU on one 1e9 B/s link that a long collective holds (level 2):
    a request's first flow (1e8 B, due at 1.0) waits deferred below it, due for promotion at
    0.8 on its own bytes. At 0.1 a second flow (3e8 B) of the request opens: the request's
    4e8 B reach MLU 0.5 at 0.2, and both flows must be promoted then (sharing the link
    above the collective: the first done at 0.4, the second at 0.6), with timers as with the
    sweep. Without the re-timing the first kept its 0.8 timer and finished at 0.9."""
    policy = create(
        "rmlq",
        {"rho_source": "none", "feasibility": False, "mlu_scope": "request"},
        num_levels=8,
    )
    config = SimConfig(chunk_bytes=0, timer_period=1e-3, promotion=promotion)
    sim = Simulator({"a": 1e9}, policy, config)
    sim.at(0.0, lambda: sim.open_flow(FlowClass.TP, int(1e10), ("a",), job="j", consumer_index=0))
    for start, size in ((0.0, 1e8), (0.1, 3e8)):
        sim.at(start, lambda size=size: sim.open_flow(
            FlowClass.KV, int(size), ("a",), deadline=1.0, request="r"
        ))  # fmt: skip
    sim.run(until=2.0)
    finished = {r.flow_id: r.finished for r in sim.records.flows if r.cls == "kv"}
    assert set(finished) == {2, 3}
    assert finished == {2: pytest.approx(0.4, abs=2e-3), 3: pytest.approx(0.6, abs=2e-3)}


@pytest.mark.parametrize("args", [{}, {"feasibility": False}], ids=["default", "no-pruning"])
def test_rmlq_holding_an_urgent_p2d_below_its_collectives_does_not_spin(
    args: dict[str, object],
) -> None:
    """A P2D flow urgent (level 1) before its job reports prefill, then held there behind a
    flow at level 0 that fills the link: rmlq's next_change answered 1 us ahead at every
    evaluation once the flow's time left reached 25 ms (50,008 events in 0.1 s of simulated
    time, 850,005 in 0.5 s without pruning). Only the deadline can change it by time now."""
    sim = Simulator({"l": 1e9}, create("rmlq", args), SimConfig(chunk_bytes=0))
    held = sim.open_flow(FlowClass.KV, 10**8, ("l",), deadline=0.1, job="j", request="a")
    hog = sim.open_flow(FlowClass.KV, 10**9, ("l",), deadline=0.02, request="b")
    assert (held.level, hog.level) == (1, 0)
    sim.at(0.001, lambda: sim.set_job_index("j", 0))
    sim.run(until=0.5)
    assert held.level == (7 if not args else 1)  # late: pruned at its deadline by default
    assert sim.events_processed < 100


def test_a_decision_withdrawn_before_its_message_boundary_is_not_applied() -> None:
    # flow 1 is promoted at t=0.5 (25 B sent; 40-byte messages: due at t=0.8) and demoted back
    # at t=0.75, before the boundary: the promotion never happens, both share fairly to t=2
    policy = FixedPolicy(promote={1: [(0.5, 0), (0.75, 1)]})
    sim = Simulator({"l": 100.0}, policy, SimConfig(chunk_bytes=40, timer_period=0.25))
    _open(sim, 0, 100, ("l",), 1)
    _open(sim, 0, 100, ("l",), 1)
    assert _finish_times(sim) == pytest.approx({1: 2.0, 2: 2.0})


def test_a_decision_made_again_after_its_withdrawal_is_applied() -> None:
    # as above, then promoted again at t=1 (50 B sent): the withdrawal left the flow's level at
    # 1, so the new promotion is a change; applied at 80 B (t=1.6), 20 B at 100 B/s -> 1.8
    policy = FixedPolicy(promote={1: [(0.5, 0), (0.75, 1), (1.0, 0)]})
    sim = Simulator({"l": 100.0}, policy, SimConfig(chunk_bytes=40, timer_period=0.25))
    _open(sim, 0, 100, ("l",), 1)
    _open(sim, 0, 100, ("l",), 1)
    assert _finish_times(sim) == pytest.approx({1: 1.8, 2: 2.0})


@pytest.mark.parametrize("promotion", ["timers", "sweep"])
def test_an_earlier_deadline_re_ranks_the_open_flows_of_a_rank_policy(promotion: str) -> None:
    # edf: flow 2 (deadline 1) opens at t=0.5 below flow 1 (deadline 10, 50 B sent): flow 1
    # moves down at once, so flow 2 takes the whole link (done at 1.5) and flow 1 ends at 2
    config = SimConfig(chunk_bytes=0, timer_period=10.0, promotion=promotion)
    sim = Simulator({"l": 100.0}, create("edf"), config)
    for at, deadline in ((0.0, 10.0), (0.5, 1.0)):
        sim.at(at, lambda d=deadline: sim.open_flow(FlowClass.KV, 100, ("l",), deadline=d))
    assert _finish_times(sim) == pytest.approx({1: 2.0, 2: 1.5})


@pytest.mark.parametrize("promotion", ["timers", "sweep"])
def test_llf_re_ranks_as_the_flows_send(promotion: str) -> None:
    # 1 GB/s: A (100 MB due at 1.0) must start by 0.9, B (10 MB due at 0.95) by 0.94, so A
    # goes first. Sending moves A's latest start later (0.9 + its bytes / 1 GB/s): at 0.04 it
    # reaches B's, and from then on the two keep equal laxity, sharing the link, so B ends at
    # 0.06 with 50 MB of A sent. Ranked only at their opening, B waited for A (0.11).
    config = SimConfig(chunk_bytes=0, timer_period=1e-3, promotion=promotion)
    sim = Simulator({"l": 1e9}, create("llf", num_levels=8), config)
    for size, deadline in ((100_000_000, 1.0), (10_000_000, 0.95)):
        sim.at(0.0, lambda s=size, d=deadline: sim.open_flow(FlowClass.KV, s, ("l",), deadline=d))
    finish = _finish_times(sim)
    assert finish[2] == pytest.approx(0.06, abs=1.5e-3)
    assert finish[1] == pytest.approx(0.11, abs=1e-6)


class HeldWhileInJob(FixedPolicy):
    """Level 1 while the flow's job is in the job index, 0 after; per-flow, no timers."""

    per_flow_decisions = True

    def _decision(self, flow: Flow, now: float) -> Decision:
        return Decision(1 if flow.job in self._jobs else 0)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        self._jobs = dict(ctx.job_index)
        return super().admit(flow, ctx)

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        self._jobs = dict(ctx.job_index)
        return super().reevaluate(flows, ctx)


@pytest.mark.parametrize("promotion", ["timers", "sweep"])
def test_a_job_that_ends_re_evaluates_its_flows(promotion: str) -> None:
    # 100 B at 100 B/s, held below a level-0 flow of 100 B until its job ends at 0.5: it
    # shares from then, so the other (opened at 0) ends at 1.5 and it at 2.0; left held, 1.0
    # and 2.0 the other way round
    config = SimConfig(chunk_bytes=0, timer_period=10.0, promotion=promotion)
    sim = Simulator({"l": 100.0}, HeldWhileInJob(), config)  # type: ignore[arg-type]
    sim.set_job_index("j", 0)
    sim.at(0.0, lambda: sim.open_flow(FlowClass.KV, 100, ("l",), job="j"))
    sim.at(0.0, lambda: sim.open_flow(FlowClass.KV, 100, ("l",)))
    sim.at(0.5, lambda: sim.end_job("j"))
    assert _finish_times(sim) == pytest.approx({1: 2.0, 2: 1.5})
