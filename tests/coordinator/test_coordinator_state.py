"""ClusterState: flow table bookkeeping and which flows each event re-evaluates."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from coordinator_helpers import BytesPolicy, DeadlineStepPolicy
from hypothesis import given, settings
from hypothesis import strategies as st

from flowsched.compiled import is_compiled
from flowsched.coordinator.state import (
    QUARANTINE_RETRY_FIRST,
    QUARANTINE_RETRY_MAX,
    SWEEP_STEP,
    ClusterState,
)
from flowsched.model import Context, Decision, Flow, FlowClass
from flowsched.policies import create
from flowsched.protocol import (
    RESYNC_FRAME_OPENS,
    FlowClose,
    FlowOpen,
    JobProgress,
    LevelUpdate,
    NicLoadEntry,
)


def _open(wire_id: int, **kw: object) -> FlowOpen:
    return FlowOpen(wire_id, FlowClass.KV, 0.0, **kw)  # type: ignore[arg-type]


@pytest.fixture
def policy() -> BytesPolicy:
    return BytesPolicy()


@pytest.fixture
def state(policy: BytesPolicy) -> ClusterState:
    return ClusterState(policy)


def test_open_queues_the_admitted_level_for_the_owning_node(state: ClusterState) -> None:
    state.open_flows("a", [_open(1), _open(2, sent=250)], now=1.0)
    state.open_flows("b", [_open(1)], now=1.0)
    outbox = state.flush(1.0)
    assert outbox == {
        "a": {1: LevelUpdate(1, 7), 2: LevelUpdate(2, 5)},
        "b": {1: LevelUpdate(1, 7)},
    }
    assert state.flush(1.0) == {}  # nothing changed: nothing sent


def test_progress_promotes_only_the_reported_flow(state: ClusterState, policy: BytesPolicy) -> None:
    state.open_flows("a", [_open(1), _open(2)], now=1.0)
    state.flush(1.0)
    policy.seen.clear()
    state.progress("a", (2, 99), (300, 5))  # 99 is unknown: ignored
    assert state.flush(2.0) == {"a": {2: LevelUpdate(2, 4)}}
    assert len(policy.seen) == 1
    assert state.stats.promotions == 1


def test_progress_never_moves_sent_backwards(state: ClusterState) -> None:
    state.open_flows("a", [_open(1)], now=1.0)
    state.progress("a", [1], [500])
    state.progress("a", [1], [100])
    assert next(iter(state.flows.values())).sent == 500


def test_progress_takes_parallel_arrays_of_equal_length(state: ClusterState) -> None:
    state.open_flows("a", [_open(1), _open(2)], now=1.0)
    with pytest.raises(ValueError, match="2 ids but 1 byte counts"):
        state.progress("a", (1, 2), (5,))
    state.progress("a", (1, 2, 7), (5, 6, 8))  # 7 is unknown: counted, not recorded
    assert sorted(flow.sent for flow in state.flows.values()) == [5, 6]
    assert state.stats.events["progress"] == 3


@pytest.mark.parametrize(
    ("deadline", "closed_at", "outcome"),
    [
        pytest.param(10.0, 9.0, "met", id="met"),
        pytest.param(10.0, 10.5, "missed", id="missed"),
        pytest.param(None, 3.0, "none", id="no-deadline"),
    ],
)
def test_close_records_deadline_outcome(
    state: ClusterState, policy: BytesPolicy, deadline: float | None, closed_at: float, outcome: str
) -> None:
    state.open_flows("a", [_open(1, deadline=deadline)], now=1.0)
    state.close_flows("a", [FlowClose(1, 10, closed_at)], now=closed_at)
    assert state.stats.completed == {("kv", outcome): 1}
    assert not state.flows and not state.origin and policy.released
    assert sum(state.stats.slack_counts) == (0 if deadline is None else 1)


def test_job_progress_reevaluates_that_jobs_flows_only(
    state: ClusterState, policy: BytesPolicy
) -> None:
    state.open_flows("a", [_open(1, job="j1"), _open(2, job="j2"), _open(3)], now=1.0)
    state.flush(1.0)
    policy.seen.clear()
    state.job_progress(JobProgress("j1", 4, layer=2))
    state.flush(2.0)
    assert [state.origin[fid] for fid in policy.seen] == [("a", 1)]
    assert policy.last_ctx is not None
    assert policy.last_ctx.job_index == {"j1": 4, "j1/layer": 2}


def test_nic_load_updates_rho_and_reevaluates_flows_on_the_link(
    state: ClusterState, policy: BytesPolicy
) -> None:
    state.open_flows("a", [_open(1, links=("eth0",)), _open(2, links=("eth1",))], now=1.0)
    state.flush(1.0)
    policy.seen.clear()
    state.nic_load([NicLoadEntry("eth0", 1e9, 0.5)])
    state.flush(2.0)
    assert [state.origin[fid] for fid in policy.seen] == [("a", 1)]
    assert policy.last_ctx is not None and policy.last_ctx.load("eth0") == 0.5


class OfferCountingSet(set[int]):
    """A dirty set that counts the flow ids offered to it, repeats included: the work a
    frame costs the coordinator before the policy sees anything. (mypyc's compiled set
    operations do not call a subclass's methods: the tests that count run interpreted.)"""

    offered = 0

    def update(self, *others: Iterable[int]) -> None:
        items = [i for other in others for i in other]
        self.offered += len(items)
        super().update(items)


COUNTS_INTERPRETED_ONLY = pytest.mark.skipif(
    is_compiled(), reason="counts through a set subclass, which compiled set operations bypass"
)


@COUNTS_INTERPRETED_ONLY
def test_closing_many_flows_of_a_job_re_evaluates_the_rest_once(state: ClusterState) -> None:
    state.open_flows("a", [_open(i, job="j1") for i in range(1, 101)], now=1.0)
    state.flush(1.0)
    state.dirty = counting = OfferCountingSet()
    state.close_flows("a", [FlowClose(i, 10, 2.0) for i in range(1, 51)], now=2.0)
    assert {state.origin[fid][1] for fid in counting} == set(range(51, 101))
    assert counting.offered == 50  # k closes of a job of n flows cost k * n before


@COUNTS_INTERPRETED_ONLY
def test_a_link_named_many_times_in_one_report_re_evaluates_its_flows_once(
    state: ClusterState,
) -> None:
    state.open_flows("a", [_open(i, links=("a:tx",)) for i in range(1, 11)], now=1.0)
    state.flush(1.0)
    state.dirty = counting = OfferCountingSet()
    state.nic_load([NicLoadEntry("a:tx", 1e9, load) for load in (0.1, 0.2, 0.1, 0.3)])
    assert len(counting) == counting.offered == 10
    assert state.link_load["a:tx"] == 0.3


def test_resync_rebuilds_the_node_and_sends_only_differences(state: ClusterState) -> None:
    state.open_flows("a", [_open(1), _open(2), _open(3)], now=1.0)
    state.flush(1.0)
    # after a reconnect the agent has flows 2 (at level 7, as we said) and 4 (new, level 3)
    state.resync("a", (_open(2, level=7), _open(4, level=3)), now=2.0)
    outbox = state.flush(2.0)
    assert sorted(wire for _, wire in state.origin.values()) == [2, 4]
    assert outbox == {"a": {4: LevelUpdate(4, 7)}}  # flow 2 already right: not re-sent


class PlannedDecisions:
    """Decides ``decision`` for every flow (a pacing policy when it has a rate)."""

    name = "planned"
    num_levels = 8
    per_flow_decisions = True

    def __init__(self) -> None:
        self.decision = Decision(3)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        return self.decision

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        return {flow.flow_id: self.decision for flow in flows}

    def release(self, flow: Flow, ctx: Context) -> None:
        pass


@pytest.mark.parametrize(
    ("decisions", "flushed", "agent_level", "resent"),
    [
        pytest.param([Decision(3, 100.0), Decision(3, 200.0)], True, 3, LevelUpdate(1, 3, 200.0),
                     id="rate-change-while-away"),
        pytest.param([Decision(3, 100.0), Decision(3)], True, 3, LevelUpdate(1, 3),
                     id="rate-lifted-while-away"),
        pytest.param([Decision(3, 100.0)], False, 3, LevelUpdate(1, 3, 100.0),
                     id="queued-rate-popped-by-the-resync"),
        pytest.param([Decision(3, 100.0)], True, 3, LevelUpdate(1, 3, 100.0),
                     id="rate-sent-maybe-lost-with-the-connection"),
        pytest.param([Decision(3, 100.0), Decision(2, 100.0)], True, 3, LevelUpdate(1, 2, 100.0),
                     id="level-and-rate-differ"),
        pytest.param([Decision(3), Decision(3)], True, 3, None, id="never-rated"),
        pytest.param([Decision(3), Decision(2)], True, 3, LevelUpdate(1, 2), id="level-differs"),
    ],
)  # fmt: skip
def test_a_resync_re_sends_the_rate_of_every_flow_ever_rated(
    decisions: list[Decision], flushed: bool, agent_level: int, resent: LevelUpdate | None
) -> None:
    """The agent's resync reports levels, not rates: a rate update it missed (decided while it
    was away, queued for it and dropped by the resync, or lost with the old connection) was
    not sent again while the flow's level matched."""
    policy = PlannedDecisions()
    state = ClusterState(policy)
    policy.decision = decisions[0]
    state.open_flows("a", [_open(1)], now=1.0)
    for decision in decisions[1:] if flushed else ():
        state.flush(1.0)  # sent: whether the agent got it is unknown
        policy.decision = decision
        state.progress("a", [1], [10])  # anything that re-evaluates the flow
    if flushed:
        state.flush(2.0)  # the last decision: its agent was away
    state.resync("a", (_open(1, level=agent_level),), now=3.0)
    assert state.flush(3.0) == ({"a": {1: resent}} if resent is not None else {})
    assert state.flush(4.0) == {}  # once per resync


class CountingAdmits(BytesPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.admitted: list[int] = []

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        self.admitted.append(flow.flow_id)
        return super().admit(flow, ctx)


FULL = RESYNC_FRAME_OPENS


@pytest.mark.parametrize(
    ("known", "frames", "kept", "new"),
    [
        # (wire ids the coordinator knows; the agent's frames: ("resync" | "flows", wire ids);
        #  the known flows kept with their state; the new flows admitted)
        pytest.param(range(FULL + 50), [("resync", range(FULL)), ("flows", range(FULL, FULL + 50))],
                     range(FULL + 50), [], id="the-rest-in-a-flows-frame-keeps-its-state"),
        pytest.param(range(FULL + 60), [("resync", range(FULL)), ("flows", range(FULL, FULL + 50))],
                     range(FULL + 50), [], id="flows-no-frame-names-go-at-the-end"),
        pytest.param(range(FULL + 60), [("resync", range(FULL)), ("flows", range(FULL, FULL + 20)),
                                        ("flows", range(FULL + 20, FULL + 60))],
                     range(FULL + 60), [], id="several-flows-frames"),
        pytest.param(range(FULL + 9), [("resync", range(FULL)),
                                       ("flows", range(FULL + 10, FULL + 15))],
                     range(FULL), range(FULL + 10, FULL + 15), id="new-flows-in-a-flows-frame"),
        pytest.param(range(FULL + 50), [("resync", range(FULL)), ("resync", range(FULL)),
                                        ("flows", range(FULL, FULL + 50))],
                     range(FULL + 50), [], id="a-reconnect-starts-the-resync-again"),
        pytest.param(range(FULL + 50), [("resync", range(FULL)), ("resync", range(5)),
                                        ("flows", range(FULL, FULL + 50))],
                     range(5), range(FULL, FULL + 50), id="a-short-resync-is-complete-at-once"),
        pytest.param(range(10), [("resync", range(5)), ("flows", range(5, 10))],
                     range(5), range(5, 10), id="a-short-resync-then-opens"),
    ],
)  # fmt: skip
def test_a_resync_larger_than_one_frame_keeps_the_flows_its_later_frames_name(
    known: range, frames: list[tuple[str, range]], kept: range, new: range
) -> None:
    """An agent with more flows than one frame holds sends a full ``resync`` then ``flows``
    frames of opens alone: the coordinator dropped every flow the first frame did not name
    and admitted those of the later frames as new ones (new ids, strikes, rates and policy
    state lost). It now keeps them until the agent's first other frame."""
    policy = CountingAdmits()
    state = ClusterState(policy)
    state.open_flows("a", [_open(i, sent=i) for i in known], now=1.0)
    before = dict(state.by_node["a"])
    policy.admitted.clear()
    for kind, ids in frames:
        opens = tuple(_open(i, sent=i, level=7) for i in ids)
        if kind == "resync":
            state.resync("a", opens, now=2.0)
        elif "a" in state.split_resyncs:  # what the service does with a flows frame of opens
            state.continue_resync("a", opens, now=2.0)
        else:
            state.open_flows("a", opens, now=2.0)
    state.end_resync("a", now=3.0)  # the agent's next frame (progress, a heartbeat)
    table = state.by_node["a"]
    assert sorted(table) == sorted([*kept, *new])
    assert {wire_id: table[wire_id] for wire_id in kept} == {i: before[i] for i in kept}
    assert sorted(policy.admitted) == sorted(table[i] for i in new)  # the others kept theirs
    gone = [before[i] for i in known if i not in kept]
    assert sorted(policy.released) == sorted(gone)  # each released once
    assert "a" not in state.split_resyncs


NEW = range(10 * FULL, 10 * FULL + 20)  # wire ids of flows the agent opened while away


@pytest.mark.parametrize(
    ("resync", "flows", "refused_at_once", "refused_at_end"),
    [
        # (the agent's resync frame; its flows frame; refused by that frame; by the end)
        pytest.param([*range(FULL)], [*NEW[:10]], 0, 0, id="new-flows-in-the-flows-frame"),
        pytest.param([*range(FULL - 5), *NEW[:5]], [], 0, 0, id="new-flows-in-the-resync"),
        pytest.param([*range(FULL)], [*NEW[:15]], 5, 0, id="more-new-flows-than-unnamed"),
        pytest.param([*range(FULL), *NEW[:3]], [*range(FULL, FULL + 8), *NEW[3:8]], 5, 1,
                     id="named-later-the-cap-still-full-at-the-end"),
    ],
)  # fmt: skip
def test_a_split_resync_admits_new_flows_past_the_cap_once_the_unnamed_ones_go(
    resync: list[int], flows: list[int], refused_at_once: int, refused_at_end: int
) -> None:
    """The flows a split resync does not name stay until it ends, and count towards the cap:
    a new flow of the resync that the closed-while-away ones kept out was refused for good (the
    agent reports it once), though the end of the resync makes room. It now waits for the end,
    refused only if the node is still at the cap then; at most as many wait as the unnamed
    flows could make room for."""
    cap = FULL + 10
    state = ClusterState(BytesPolicy(), max_flows_per_node=cap)
    state.open_flows("a", [_open(i) for i in range(cap)], now=1.0)  # at the cap
    state.resync("a", tuple(_open(i) for i in resync), now=2.0)
    at_once = state.continue_resync("a", tuple(_open(i) for i in flows), now=2.0) if flows else 0
    assert at_once == refused_at_once
    assert state.end_resync("a", now=3.0) == refused_at_end
    named = {*resync, *flows}
    table = state.by_node["a"]
    assert len(table) == len(named) - refused_at_once - refused_at_end
    assert set(table) <= named
    assert {i for i in named if i < cap} <= set(table)  # the known flows named are kept
    assert state.stats.refused_opens == refused_at_once + refused_at_end


def test_a_split_resync_keeps_the_unnamed_flows_until_it_ends(state: ClusterState) -> None:
    state.open_flows("a", [_open(i) for i in range(FULL + 2)], now=1.0)
    state.resync("a", tuple(_open(i, level=7) for i in range(FULL)), now=2.0)
    assert len(state.by_node["a"]) == FULL + 2  # more of the resync may come
    state.continue_resync("a", (_open(FULL, level=7),), now=2.0)
    state.drop_node("a", now=3.0)  # the agent went away for good mid-resync
    assert "a" not in state.split_resyncs
    state.end_resync("a", now=3.0)  # nothing left to end
    assert not state.flows


def test_drop_node_forgets_its_flows_only(state: ClusterState, policy: BytesPolicy) -> None:
    state.open_flows("a", [_open(1)], now=1.0)
    state.open_flows("b", [_open(1)], now=1.0)
    state.drop_node("a", now=2.0)
    assert [node for node, _ in state.origin.values()] == ["b"]
    assert len(policy.released) == 1


def test_timer_sweep_advances_in_budgeted_steps(policy: BytesPolicy) -> None:
    ticks = itertools.count()
    state = ClusterState(policy, clock=lambda: float(next(ticks)))  # each reading: +1 s
    state.open_flows("a", [_open(i, deadline=9.0) for i in range(100)], now=1.0)
    state.open_flows("a", [_open(100)], now=1.0)  # no deadline: time alone never changes it
    state.flush(1.0)
    policy.seen.clear()
    assert state.start_sweep()
    state.flush(2.0, sweep_budget=0.5)  # the budget is spent after the first step
    assert len(policy.seen) == SWEEP_STEP and state.pending
    assert not state.start_sweep()  # the unfinished sweep is not restarted
    state.progress("a", [0], [1])
    state.flush(2.0, sweep_budget=0.0)  # events only
    assert len(policy.seen) == SWEEP_STEP + 1
    while state.pending:
        state.flush(2.0, sweep_budget=0.5)
    swept = [state.origin[fid][1] for fid in policy.seen]
    assert set(swept) == set(range(100)) and len(swept) <= 101  # each flow about once
    assert (state.stats.sweeps, state.stats.sweep_overruns) == (1, 1)


def test_rank_based_policies_always_see_every_flow() -> None:
    state = ClusterState(create("edf", num_levels=4))
    assert not state.per_flow
    opens = [_open(i, deadline=100.0 - i) for i in range(4)]
    state.open_flows("a", opens, now=1.0)
    outbox = state.flush(1.0)
    levels = {update.id: update.level for update in outbox["a"].values()}
    assert levels[3] < levels[0]  # the earliest deadline ranks first


@pytest.mark.parametrize("job", [None, "j"], ids=["no-job", "the-jobs-last-flow"])
def test_rank_based_policies_rank_again_after_any_close(job: str | None) -> None:
    """A close changes every rank behind the closed flow: the flows move up at the next flush,
    also when the closed flow had no job, or was its job's last (before, a close re-evaluated
    only the rest of its job, and these ranks stayed until some other event)."""
    state = ClusterState(create("edf", num_levels=4))
    opens = [_open(0, deadline=50.0, job=job)] + [
        _open(i, deadline=100.0 - i, job=f"other{i}") for i in range(1, 6)
    ]  # six deadlines over the three top levels: two a level, then fewer behind the closed
    state.open_flows("a", opens, now=1.0)
    before = {update.id: update.level for update in state.flush(1.0)["a"].values()}
    state.close_flows("a", [FlowClose(0, 0, 2.0)], 2.0)
    assert state.pending
    after = {update.id: update.level for update in state.flush(2.0).get("a", {}).values()}
    assert after and all(after[wire] < before[wire] for wire in after), (before, after)


@pytest.mark.parametrize("gone", ["drop_node", "resync", "split_resync"])
def test_rank_based_policies_rank_again_when_a_flow_goes_without_a_close(gone: str) -> None:
    """Flows that go without a close report (their agent stayed away past the grace period, or
    its resync no longer names them) change the ranks of the rest as a close does: before,
    the rest kept the ranks they had next to them until some other event."""
    state = ClusterState(create("edf", num_levels=4))
    state.open_flows("a", [_open(0, deadline=50.0)], now=1.0)
    state.open_flows("b", [_open(i, deadline=100.0 - i) for i in range(1, 6)], now=1.0)
    # the split resync's case: node a has FULL more flows, 64 of them ahead of all others: b's
    # flows rank 65..69 of 206, the last in the second of three bands until flow 0 goes
    extra = [_open(i, deadline=20.0 if i <= 64 else 200.0) for i in range(1, FULL + 1)]
    if gone == "split_resync":
        state.open_flows("a", extra, now=1.0)
    before = {update.id: update.level for update in state.flush(1.0)["b"].values()}
    if gone == "drop_node":
        state.drop_node("a", now=2.0)
    elif gone == "resync":
        state.resync("a", (), now=2.0)
    else:
        state.resync("a", tuple(extra), now=2.0)  # all but flow 0, in one frame of two
        state.flush(2.0)
        state.end_resync("a", now=2.0)
    assert 0 not in state.by_node.get("a", {})
    assert state.pending
    after = {update.id: update.level for update in state.flush(2.0).get("b", {}).values()}
    assert after and all(after[wire] < before[wire] for wire in after), (before, after)


def test_active_flows_by_class_and_level(state: ClusterState) -> None:
    state.open_flows("a", [_open(1), _open(2, sent=100)], now=1.0)
    state.open_flows("a", [FlowOpen(3, FlowClass.TP, 0.0)], now=1.0)
    assert state.active_by_class_level() == {
        (FlowClass.KV, 7): 1,
        (FlowClass.KV, 6): 1,
        (FlowClass.TP, 7): 1,
    }


def test_level_updates_carry_the_decision_time(policy: BytesPolicy) -> None:
    """decided_at = the policy's wall-clock now; decided_ns = the monotonic clock at decision."""
    ticks = itertools.count(1000, 1000)
    state = ClusterState(policy, mono_clock=lambda: next(ticks))
    state.open_flows("a", [_open(1)], now=5.0)  # admission: decided while opening
    admitted = state.flush(5.0)["a"][1]
    assert (admitted.decided_at, admitted.decided_ns) == (5.0, 1000)
    state.progress("a", [1], [300])
    promoted = state.flush(7.5)["a"][1]
    assert promoted.level == 4 and (promoted.decided_at, promoted.decided_ns) == (7.5, 3000)


# -- promotion timers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("promotion", "tick", "evaluated", "promoted"),
    [
        ("timers", 4.5, [], []),  # nothing due yet: a heap peek, no evaluation
        ("timers", 5.0, [1], [1]),  # flow 1 (deadline 6) is due at 5
        ("timers", 7.5, [1, 2], [1, 2]),
        ("sweep", 4.5, [1, 2, 3], []),  # the baseline evaluates every deadline flow
        ("sweep", 7.5, [1, 2, 3], [1, 2]),
    ],
    ids=["timers-early", "timers-one-due", "timers-two-due", "sweep-early", "sweep-late"],
)
def test_timer_tick_evaluates_only_the_flows_due(
    promotion: str, tick: float, evaluated: list[int], promoted: list[int]
) -> None:
    policy = DeadlineStepPolicy()
    state = ClusterState(policy, promotion=promotion)
    opens = [_open(1, deadline=6.0), _open(2, deadline=8.0), _open(3, deadline=20.0), _open(4)]
    state.open_flows("a", opens, now=1.0)
    state.flush(1.0)
    policy.seen.clear()
    assert state.start_sweep(now=tick) == bool(evaluated)
    outbox = state.flush(tick)
    assert sorted(state.origin[fid][1] for fid in policy.seen) == evaluated
    assert sorted(outbox.get("a", {})) == promoted
    assert state.promotion == promotion


def test_timers_follow_flows_and_fall_back_to_sweeps() -> None:
    policy = DeadlineStepPolicy()
    state = ClusterState(policy)
    state.open_flows("a", [_open(1, deadline=6.0), _open(2, deadline=9.0)], now=1.0)
    state.flush(1.0)
    assert state.next_due() == 5.0
    state.close_flows("a", [FlowClose(1, 0, 2.0)], now=2.0)  # its timer goes with it
    assert state.next_due() == 8.0
    assert not state.start_sweep(now=6.0)
    assert state.start_sweep(now=8.0) and state.flush(8.0) == {"a": {2: LevelUpdate(2, 0)}}
    assert state.next_due() is None and state.stats.timer_fires == 1
    # a policy without next_change (or promotion="sweep") is swept
    assert ClusterState(BytesPolicy()).promotion == "sweep"
    with pytest.raises(ValueError, match="promotion"):
        ClusterState(policy, promotion="wheel")


def test_rmlq_deferred_flow_is_promoted_by_its_timer() -> None:
    """The real policy: 1e8 bytes due at t=101 on 1e9 B/s, rho 0: band [0.125, 0.5) from
    MLU 0.125 (0.8 s left, a little earlier with the worst-case rise of rho)."""
    policy = create("rmlq", {"feasibility": False, "deferred_order": "mlu"}, num_levels=8)
    state = ClusterState(policy, default_bandwidth=1e9)
    state.open_flows("a", [_open(1, size=int(1e8), deadline=101.0, links=("l",))], now=100.0)
    assert state.flush(100.0)["a"][1].level == 6
    due = state.next_due()
    assert due is not None and 100.0 < due <= 100.2
    assert not state.start_sweep(now=due - 1e-3)
    promoted = {}
    now = due
    while not promoted:  # early timers re-arm until the crossing
        assert state.start_sweep(now=now)
        promoted = state.flush(now)
        now = state.next_due() or now
    update = promoted["a"][1]
    assert update.level == 5
    assert 100.2 - 1e-6 <= update.decided_at <= 100.2 + 1e-3  # not late, not much early
    assert state.stats.timer_fires < 100  # re-arms near the crossing, not a sweep per tick


@pytest.mark.parametrize("size", [None, 10**8], ids=["unknown-size", "sized"])
def test_rmlq_late_kv_flow_reaches_the_scavenger_by_its_deadline(size: int | None) -> None:
    """A kv flow opened with a deadline, with or without a size (an SDK flow may give none),
    and nothing else happening: its promotion timers move it to the scavenger level by its
    deadline (a sized one maybe earlier: Algorithm 1, no bytes reported). Without a size it
    has no MLU, sits at unknown_level, and its one timer is the deadline; it had none and
    stayed at unknown_level for good."""
    policy = create("rmlq", {}, num_levels=8)
    state = ClusterState(policy, default_bandwidth=1e9)
    state.open_flows("a", [_open(1, size=size, deadline=101.0, links=("l",))], now=100.0)
    assert state.flush(100.0)["a"][1].level < 7
    fires = []
    while (due := state.next_due()) is not None:
        assert state.start_sweep(now=due)
        fires.append((due, state.flush(due).get("a", {}).get(1)))
    assert fires, "no promotion timer"
    last_due, update = fires[-1]
    assert update is not None and update.level == 7 and last_due <= 101.0
    if size is None:
        assert [due for due, _ in fires] == [101.0]


def test_rmlq_pruned_request_moves_its_untouched_flows_in_the_same_flush() -> None:
    """Default rmlq (Algorithm 1 on, per-flow): on one 1e9 B/s link r1 needs 0.5 s by 101.0;
    r2's second flow (0.9 s by 101.2) makes r2 infeasible, and its flow on node b, not
    touched by that event, goes to the scavenger level with it, its timer dropped."""
    policy = create("rmlq", {}, num_levels=8)
    state = ClusterState(policy, default_bandwidth=1e9)
    assert state.per_flow
    r1 = _open(1, size=int(5e8), deadline=101.0, request="r1", links=("l",))
    state.open_flows("a", [r1], now=100.0)
    state.open_flows("b", [_open(3, size=int(1e6), deadline=105.0, request="r2", links=("l",))],
                     now=100.0)  # fmt: skip
    assert state.flush(100.0) == {"a": {1: LevelUpdate(1, 1)}, "b": {3: LevelUpdate(3, 6)}}
    untouched = state.by_node["b"][3]
    assert untouched in state._due_at  # its promotion timer
    late = _open(2, size=int(9e8), deadline=101.2, request="r2", links=("l",))
    state.open_flows("a", [late], now=100.1)
    outbox = state.flush(100.1)
    assert state.last_batch == 1  # only the opened flow was passed
    assert {n: {w: u.level for w, u in box.items()} for n, box in outbox.items()} == {
        "a": {2: 7},
        "b": {3: 7},
    }
    assert state.flows[untouched].level == 7 and untouched not in state._due_at


# -- progress with promotion timers ---------------------------------------------------------


class Hiding:
    """The policy it wraps, minus the optional hooks named (a caller then takes its baseline
    path: ``observe_progress`` hidden, every progress report re-evaluates; ``released_affects``
    hidden, a close re-evaluates the rest of its job)."""

    def __init__(self, inner: object, *hidden: str) -> None:
        self._inner = inner
        self._hidden = hidden

    def __getattr__(self, name: str) -> object:
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._inner, name)


class CountingCalls:
    """The policy it wraps, noting each flow passed to ``reevaluate`` or ``observe_progress``
    (a wrapper, not a patched method: the compiled policy's methods are read-only)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        active = list(flows)
        self.calls.extend("reevaluate" for _ in active)
        decided: Mapping[int, Decision] = self._inner.reevaluate(active, ctx)
        return decided

    def observe_progress(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        active = list(flows)
        self.calls.extend("observe" for _ in active)
        decided: Mapping[int, Decision] = self._inner.observe_progress(active, ctx)
        return decided

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def _levels(outbox: Mapping[str, Mapping[int, LevelUpdate]]) -> dict[tuple[str, int], int]:
    return {(node, wire): u.level for node, box in outbox.items() for wire, u in box.items()}


def _replay(state: ClusterState, seed: int, steps: int = 60) -> list[dict[tuple[str, int], int]]:
    """A random cluster history (opens, progress, closes, job steps, link loads, timers) fed
    to ``state``; the level changes of each flush."""
    rng = random.Random(seed)
    links = [f"n{i}/eth0" for i in range(3)]
    classes = [FlowClass.KV, FlowClass.KV, FlowClass.PARAM_SYNC, FlowClass.TP, FlowClass.BULK]
    opened: dict[str, dict[int, int]] = {"a": {}, "b": {}}  # node -> wire id -> size
    sent: dict[tuple[str, int], int] = {}
    #: KV requests so far: (name, deadline, job), for their later flows (the next layer's)
    requests: list[tuple[str, float, str | None]] = []
    wire_ids = itertools.count()
    history = []
    now = 100.0
    for _ in range(steps):
        step = rng.choice([1e-4, 1e-3, 5e-3, 0.02])
        now += step
        node = rng.choice("ab")
        if rng.random() < 0.4:  # a transfer opens: one flow, or a request's flows at once
            cls = rng.choice(classes)
            explicit = cls in (FlowClass.KV, FlowClass.PARAM_SYNC)
            deadline = now + rng.uniform(0.01, 0.5) if explicit else None
            request = f"r{next(wire_ids)}" if cls is FlowClass.KV else None
            job = rng.choice([None, "j"]) if cls is FlowClass.KV else None
            if request is not None and requests and rng.random() < 0.5:
                request, deadline, job = rng.choice(requests)  # a later flow of a request
            elif request is not None:
                requests.append((request, deadline or 0.0, job))
            opens = []
            for _ in range(rng.randint(1, 3) if request else 1):
                wire, size = next(wire_ids), rng.choice([10**6, 10**7, 10**8])
                opens.append(FlowOpen(
                    wire, cls, now, size=size, deadline=deadline, job=job, request=request,
                    links=(rng.choice(links),),
                ))  # fmt: skip
                opened[node][wire] = size
                sent[(node, wire)] = 0
            state.open_flows(node, opens, now)
        ids, reports = [], []
        # each flow at most its share of a 1e9 B/s link: byte counts a network could produce
        share = int(1e9 * step / max(len(opened["a"]) + len(opened["b"]), 1))
        for wire, size in opened[node].items():
            if rng.random() < 0.7:
                sent[(node, wire)] = min(size, sent[(node, wire)] + rng.randrange(share + 1))
                ids.append(wire)
                reports.append(sent[(node, wire)])
        state.progress(node, ids, reports)
        if opened[node] and rng.random() < 0.1:
            wire = rng.choice(list(opened[node]))
            del opened[node][wire]
            state.close_flows(node, [FlowClose(wire, sent[(node, wire)], now)], now)
        if rng.random() < 0.1:
            state.job_progress(JobProgress("j", rng.randrange(3)))
        if rng.random() < 0.1:
            state.nic_load([NicLoadEntry(rng.choice(links), 1e9, rng.random())])
        state.start_sweep(now)
        history.append(_levels(state.flush(now)))
    return history


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scope=st.sampled_from(["flow", "request"]))
def test_promotion_timers_decide_as_sweeping_every_flow(seed: int, scope: str) -> None:
    """rmlq with exact timers (rho from the link capacity alone): deciding each flow when its
    timer comes gives the same level changes at the same flushes as the baseline sweep, which
    re-evaluates every flow with a deadline at every tick. With ``mlu_scope = "request"`` a
    flow's MLU counts its request's other flows on its path, so a later flow of the request
    brings the earlier ones' promotions forward: their timers must follow."""
    args = {"rho_source": "none", "feasibility": False, "mlu_scope": scope}
    timers = ClusterState(create("rmlq", args, num_levels=8), default_bandwidth=1e9)
    swept = ClusterState(
        create("rmlq", args, num_levels=8), default_bandwidth=1e9, promotion="sweep"
    )
    assert timers.promotion == "timers" and swept.promotion == "sweep"
    assert _replay(timers, seed) == _replay(swept, seed)


class CountingReevaluations(CountingCalls):
    """:class:`CountingCalls`, also counting the calls of ``reevaluate`` (with no flow too)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.reevaluations = 0

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        self.reevaluations += 1
        return super().reevaluate(flows, ctx)


@pytest.mark.parametrize("hook", ["observe_progress", "released_affects"])
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scope=st.sampled_from(["flow", "request"]))
def test_rmlqs_optional_hooks_decide_as_the_paths_they_shortcut(
    hook: str, seed: int, scope: str
) -> None:
    """rmlq with exact timers (rho from the link capacity alone, Algorithm 1 off: it runs at
    the first policy call once due, and the two paths make different calls) gives the same
    level changes at the same flushes with each optional hook as without it:

    * ``observe_progress``: progress reports only feed the policy and each flow is decided
      when its timer comes, against re-evaluating every reported flow. With the measured rho
      the timers assume its fastest rise under physical byte counts and step near a crossing,
      so a decision can come a timer later than a report would have brought it (as in the
      simulator, which never re-evaluates on bytes).
    * ``released_affects``: a close re-evaluates only the flows the policy names, against the
      rest of the job. With the measured rho or the feasibility checks on, a change that time
      alone brings comes at the first evaluation after it: re-evaluating the job at a
      sibling's close caught some before the flow's timer or Algorithm 1's next run, which
      bring them with the hook, as in a job that sees no close.
    """
    args = {"rho_source": "none", "feasibility": False, "mlu_scope": scope}
    hooked = ClusterState(create("rmlq", args, num_levels=8), default_bandwidth=1e9)
    baseline = ClusterState(
        Hiding(create("rmlq", args, num_levels=8), hook),  # type: ignore[arg-type]
        default_bandwidth=1e9,
        per_flow=True,
    )
    assert getattr(hooked.policy, hook) and not hasattr(baseline.policy, hook)
    assert _replay(hooked, seed, steps=120) == _replay(baseline, seed, steps=120)


def test_a_close_marks_only_the_flows_the_policy_names() -> None:
    """A close of one flow of a large job makes no other flow dirty when the policy names
    none (the whole job cost the coordinator's loop about 0.3 s per close frame at 65,536
    flows: bench/job_close.py), and the next flush still calls the policy."""
    policy = CountingReevaluations(create("rmlq", num_levels=8))
    state = ClusterState(policy, default_bandwidth=1e9)  # type: ignore[arg-type]
    now = 100.0
    opens = [_open(w, size=10**6, deadline=now + 1, job="j") for w in range(50)]
    state.open_flows("a", opens, now)
    state.flush(now)
    policy.calls.clear()
    policy.reevaluations = 0
    state.close_flows("a", [FlowClose(7, 10**6, now + 0.001)], now + 0.001)
    assert not state.dirty and state.pending
    state.flush(now + 0.001)
    assert policy.calls == [] and policy.reevaluations == 1
    assert not state.pending


def test_progress_feeds_the_policy_without_deciding_and_the_timer_promotes() -> None:
    """A deferred rmlq flow's progress reports reach observe_progress, not reevaluate; its
    promotion comes from its timer, with no sweep."""
    policy = CountingCalls(
        create("rmlq", {"feasibility": False, "deferred_order": "mlu"}, num_levels=8)
    )
    calls = policy.calls
    state = ClusterState(policy, default_bandwidth=1e9)  # type: ignore[arg-type]
    state.open_flows("a", [_open(1, size=int(1e8), deadline=101.0, links=("l",))], now=100.0)
    assert state.flush(100.0)["a"][1].level == 6
    calls.clear()
    for step in range(1, 6):  # 1e6 bytes per 10 ms: MLU keeps rising, not yet at 0.125
        state.progress("a", [1], [step * 10**6])
        assert state.flush(100.0 + step * 0.01) == {}
    assert calls == ["observe"] * 5
    due = state.next_due()
    assert due is not None
    now = due
    promoted: dict[str, dict[int, LevelUpdate]] = {}
    while not promoted:
        assert state.start_sweep(now=now)
        promoted = state.flush(now)
        now = state.next_due() or now
    assert promoted["a"][1].level == 5
    assert set(calls) == {"observe", "reevaluate"} and state.stats.sweeps == state.stats.timer_fires


def test_a_burst_of_due_timers_is_decided_in_bounded_steps() -> None:
    """1,000 flows due at the same instant: each flush with a budget decides one step of
    them (the rest after the next reads), never the whole burst in one loop turn."""
    ticks = itertools.count()
    policy = DeadlineStepPolicy()
    state = ClusterState(policy, clock=lambda: float(next(ticks)))  # each reading: +1 s
    state.open_flows("a", [_open(i, deadline=6.0) for i in range(1000)], now=1.0)
    state.flush(1.0)
    policy.seen.clear()
    assert state.start_sweep(now=5.0)
    turns = 0
    while state.pending:
        before = len(policy.seen)
        state.flush(5.0, sweep_budget=0.5)
        assert len(policy.seen) - before <= SWEEP_STEP
        turns += 1
    assert turns >= 1000 // SWEEP_STEP and sorted(policy.seen) == sorted(state.flows)


def test_sweep_steps_shrink_to_the_budget_at_the_measured_cost_per_flow() -> None:
    """Each evaluation costs 0.1 ms of the injected clock. The first step (no measurement
    yet) is a whole SWEEP_STEP; from then on a flush with a 0.25 ms budget evaluates what
    fits in it (2 flows, then 1 more once the budget is spent), not another SWEEP_STEP."""
    now = [0.0]

    class CostlyPolicy(DeadlineStepPolicy):
        def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
            flows = list(flows)
            now[0] += 1e-4 * len(flows)
            return super().reevaluate(flows, ctx)

    policy = CostlyPolicy()
    state = ClusterState(policy, clock=lambda: now[0])
    state.open_flows("a", [_open(i, deadline=6.0) for i in range(200)], now=1.0)
    state.flush(1.0)
    policy.seen.clear()
    assert state.start_sweep(now=5.0)
    per_flush = []
    while state.pending:
        before = len(policy.seen)
        state.flush(5.0, sweep_budget=0.25e-3)
        per_flush.append(len(policy.seen) - before)
    assert per_flush[0] == SWEEP_STEP
    assert max(per_flush[1:]) <= 3, per_flush
    assert sum(per_flush) == 200


# -- hardening: a node's flow cap, its links, the policy's failures (docs/security.md) --------


@pytest.mark.parametrize(
    ("cap", "batches", "admitted", "refused"),
    [
        pytest.param(3, [[1, 2, 3, 4, 5]], [1, 2, 3], 2, id="one-frame-over"),
        pytest.param(3, [[1, 2], [3, 4], [5]], [1, 2, 3], 2, id="frame-by-frame"),
        pytest.param(2, [[1, 2], [1, 2]], [1, 2], 0, id="re-sent-opens-are-updates"),
        pytest.param(65536, [list(range(100))], list(range(100)), 0, id="default-room"),
    ],
)
def test_a_node_has_at_most_its_cap_of_open_flows(
    cap: int, batches: list[list[int]], admitted: list[int], refused: int
) -> None:
    state = ClusterState(BytesPolicy(), max_flows_per_node=cap)
    got = sum(state.open_flows("a", [_open(i) for i in ids], now=1.0) for ids in batches)
    state.open_flows("b", [_open(i) for i in range(cap)], now=1.0)  # another node: its own cap
    assert (got, state.stats.refused_opens) == (refused, refused)
    assert sorted(state.by_node["a"]) == admitted
    assert len(state.by_node["b"]) == cap
    outbox = state.flush(1.0)
    assert sorted(outbox["a"]) == admitted  # a refused flow gets no level: its agent's stays
    state.close_flows("a", [FlowClose(admitted[0], 0, 2.0)], now=2.0)  # room again
    assert state.open_flows("a", [_open(1000)], now=2.0) == 0


@pytest.mark.parametrize("defer", [False, True])
def test_a_resync_over_the_cap_keeps_the_first_flows(defer: bool) -> None:
    state = ClusterState(BytesPolicy(), max_flows_per_node=4)
    assert state.resync("a", tuple(_open(i) for i in range(10)), 1.0, defer=defer) == 6
    state.settle_resyncs()
    assert sorted(state.by_node["a"]) == [0, 1, 2, 3]
    assert sorted(state.flush(1.0)["a"]) == [0, 1, 2, 3]


def test_a_dropped_node_takes_its_link_loads_along(state: ClusterState) -> None:
    state.nic_load(
        [NicLoadEntry(link, 1e9, 0.5) for link in ("a:tx", "a:rx", "b:tx", "b:rx", "ab:tx")]
    )
    state.open_flows("b", [_open(1, links=("b:tx", "a:rx"))], now=1.0)
    state.drop_node("a", now=2.0)
    assert sorted(state.link_bandwidth) == sorted(state.link_load) == ["ab:tx", "b:rx", "b:tx"]
    assert state.context(2.0).bandwidth("a:rx") == state.default_bandwidth  # b's flow to a


def test_a_dropped_nodes_links_reevaluate_the_flows_left_on_them(
    state: ClusterState, policy: BytesPolicy
) -> None:
    """The capacity and load a dropped node reported go, as a report of new ones would change
    them: the other nodes' flows to it are re-evaluated (a per-flow policy kept the levels it
    gave them on the reported capacity until some other event)."""
    state.nic_load([NicLoadEntry("a:rx", 1e9, 0.5), NicLoadEntry("b:rx", 1e9, 0.5)])
    state.open_flows("b", [_open(1, links=("b:tx", "a:rx")), _open(2, links=("b:tx",))], now=1.0)
    state.flush(1.0)
    policy.seen.clear()
    state.drop_node("a", now=2.0)
    state.flush(2.0)
    assert [state.origin[fid] for fid in policy.seen] == [("b", 1)]


@pytest.mark.parametrize(
    ("reported", "stored"), [(0.0, 1.0), (5e-324, 1.0), (0.5, 1.0), (1.0, 1.0), (12.5e9, 12.5e9)]
)
def test_link_capacities_below_one_byte_per_second_are_stored_as_one(
    state: ClusterState, reported: float, stored: float
) -> None:
    state.nic_load([NicLoadEntry("a:tx", reported, 0.0)])
    assert state.link_bandwidth["a:tx"] == stored


class _RaisingPolicy(DeadlineStepPolicy):
    """DeadlineStepPolicy whose ``hook`` raises on flows of node "evil" (an rmlq bug, or a
    poisoned link, as in docs/security.md's H2)."""

    def __init__(self, hook: str, per_flow: bool = True) -> None:
        super().__init__()
        self.hook = hook
        self.per_flow_decisions = per_flow
        #: False: the fault has passed (it raises no more)
        self.failing = True
        #: hooks called on evil's flows
        self.calls: list[str] = []

    def _check(self, hook: str, flows: Iterable[Flow]) -> None:
        if not any(flow.node == "evil" for flow in flows):
            return
        self.calls.append(hook)
        if hook == self.hook and self.failing:
            raise ZeroDivisionError("float division by zero")

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        self._check("admit", [flow])
        return super().admit(flow, ctx)

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        flows = list(flows)
        self._check("reevaluate", flows)
        return super().reevaluate(flows, ctx)

    def next_change(self, flow: Flow, ctx: Context) -> float | None:
        self._check("next_change", [flow])
        return super().next_change(flow, ctx)

    def observe_progress(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        self._check("observe_progress", list(flows))
        return {}

    def release(self, flow: Flow, ctx: Context) -> None:
        self._check("release", [flow])
        super().release(flow, ctx)


@pytest.mark.parametrize(
    ("hook", "per_flow"),
    [
        ("admit", True),
        ("reevaluate", True),
        ("reevaluate", False),
        ("next_change", True),
        ("observe_progress", True),
        ("release", True),
    ],
)
def test_a_policy_raising_on_one_flow_spares_the_batch(
    hook: str, per_flow: bool, caplog: pytest.LogCaptureFixture
) -> None:
    state = ClusterState(_RaisingPolicy(hook, per_flow))
    # one batch: the evil flow and the victim's, both due in 0.5 s (level 0 from 1 s before)
    state.open_flows("evil", [_open(13, deadline=100.5, links=("victim:rx",))], now=100.0)
    state.open_flows("victim", [_open(1, deadline=100.5), _open(2)], now=100.0)
    outbox = state.flush(100.0)
    assert outbox["victim"][1].level == 0  # the rest of the batch was decided and sent
    state.progress("evil", [13], [100])
    state.progress("victim", [2], [100])
    state.nic_load([NicLoadEntry("victim:rx", 1e9, 0.5)])  # the victim's event: evil's flow
    state.flush(100.1)
    state.close_flows("evil", [FlowClose(13, 100, 100.2)], now=100.2)
    state.close_flows("victim", [FlowClose(1, 100, 100.2)], now=100.2)
    assert [flow.node for flow in state.flows.values()] == ["victim"]
    assert not state.quarantined and state.stats.policy_errors >= 1
    assert "flow 13 of node evil" in caplog.text
    assert "ZeroDivisionError" in caplog.text


class _MonoClock:
    """A monotonic clock for ClusterState (nanoseconds) that the test sets (``now``, s)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> int:
        return round(self.now * 1e9)


def _held_kv_levels(end_job: bool) -> list[tuple[float, int]]:
    """A batch's last-layer P2D (1 GB due in 100 ms on a 25 GB/s link) under rmlq: held below
    the collectives while its job is in prefill; (time, level) pushed over 95 ms."""
    state = ClusterState(create("rmlq", {"feasibility": False}, num_levels=8))
    now = 1000.0
    state.job_progress(JobProgress("i0/b1", 7, 7))
    kv = FlowOpen(1, FlowClass.KV, now, size=10**9, deadline=now + 0.1, job="i0/b1",
                  consumer_index=7, request="r1", links=("n0:tx",))  # fmt: skip
    state.open_flows("n0", [kv], now)
    pushed = []
    for t in (0.0, 0.02, 0.04, 0.06, 0.08, 0.095):
        if end_job and t == 0.02:
            state.job_progress(JobProgress("i0/b1", 8, None, done=True))  # prefill ended
        state.start_sweep(now + t)
        pushed += [(t, u.level) for node in state.flush(now + t).values() for u in node.values()]
    return pushed


def test_a_jobs_end_releases_its_held_kv_flows_at_once() -> None:
    """While the job runs its P2D stays at the first deferred band (5, below tp at 2); the
    job's end (protocol version 4) makes the coordinator forget it and re-evaluate the flow,
    which MLU then promotes, as in the simulator (it was held until the job's 10-minute TTL)."""
    held = _held_kv_levels(end_job=False)
    assert held == [(0.0, 6), (0.04, 5)]  # and no further change while held
    ended = _held_kv_levels(end_job=True)
    assert ended == [(0.0, 6), (0.04, 1), (0.08, 0)]  # promoted by MLU like any other


@pytest.mark.parametrize(
    ("hook", "per_flow"),
    [("admit", True), ("reevaluate", True), ("reevaluate", False), ("next_change", True)],
)
def test_a_quarantined_flow_is_decided_again_once_its_fault_passed(
    hook: str, per_flow: bool
) -> None:
    policy = _RaisingPolicy(hook, per_flow)
    mono = _MonoClock(99.5)  # (in step with the wall clock here)
    state = ClusterState(policy, mono_clock=mono)
    # due in 1.5 s: level 7 now, 0 from 100.5 on (DeadlineStepPolicy's one-second lead)
    state.open_flows("evil", [_open(13, deadline=101.5)], now=99.5)
    state.flush(99.5)
    (fid,) = state.quarantined
    assert state.next_retry() == 99.5 + QUARANTINE_RETRY_FIRST  # it wakes the timer loop
    policy.failing = False
    policy.calls.clear()
    mono.now = 100.4
    assert not state.start_sweep(100.4)  # not due yet: still quarantined
    state.flush(100.4)
    assert state.quarantined == {fid} and policy.calls == []
    mono.now = 99.5 + QUARANTINE_RETRY_FIRST
    assert state.start_sweep(99.5 + QUARANTINE_RETRY_FIRST)
    outbox = state.flush(100.5)
    assert not state.quarantined and hook in policy.calls
    assert outbox["evil"][13].level == 0  # decided again, and promoted as it is due
    state.close_flows("evil", [FlowClose(13, 100, 100.6)], now=100.6)
    assert not state.flows and not state._strikes and not state._unadmitted


def test_a_flow_the_policy_keeps_raising_on_waits_twice_as_long_each_time() -> None:
    policy = _RaisingPolicy("reevaluate")
    mono = _MonoClock(100.0)
    state = ClusterState(policy, mono_clock=mono)
    state.open_flows("evil", [_open(13, deadline=1000.0)], now=100.0)
    state.flush(100.0)
    now, waits = 100.0, []
    for _ in range(11):
        due = state.next_retry()
        assert due is not None
        waits.append(due - now)
        now = mono.now = due
        assert state.start_sweep(now)
        state.flush(now)  # raises again: quarantined again
    expected = [min(QUARANTINE_RETRY_FIRST * 2.0**n, QUARANTINE_RETRY_MAX) for n in range(11)]
    assert waits == pytest.approx(expected)
    assert waits[-1] == QUARANTINE_RETRY_MAX and state.stats.policy_errors == 11 + 1
    state.close_flows("evil", [FlowClose(13, 0, now)], now=now)
    assert state.next_retry() is None  # the closed flow's retry is gone with it


class _AdmitRegistersThenRaises:
    """rmlq (``inner``) whose first admit registers the flow, then raises, as an admit that
    fails after its bookkeeping does (rmlq counts a request's flows first thing). A wrapper,
    not a patched method: the compiled build's policy classes take no monkeypatching."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.admits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        decision = self.inner.admit(flow, ctx)
        self.admits += 1
        if self.admits == 1:
            raise ZeroDivisionError("float division by zero")
        return decision  # type: ignore[no-any-return]


def test_a_retried_admit_counts_its_request_once() -> None:
    """The retry must not count the flow twice: the request would never end, its state kept
    for good."""
    rmlq = create("rmlq")
    policy = _AdmitRegistersThenRaises(rmlq)
    mono = _MonoClock(100.0)
    state = ClusterState(policy, mono_clock=mono)  # type: ignore[arg-type]
    kv = _open(1, size=1 << 20, deadline=105.0, request="r1", links=("a:tx",))
    state.open_flows("a", [kv], now=100.0)
    assert state.quarantined
    mono.now += QUARANTINE_RETRY_FIRST
    assert state.start_sweep(100.0 + QUARANTINE_RETRY_FIRST)
    state.flush(100.0 + QUARANTINE_RETRY_FIRST)
    assert not state.quarantined and state.flows and policy.admits == 2
    state.close_flows("a", [FlowClose(1, 1 << 20, 102.0)], now=102.0)
    assert not state.flows and "r1" not in rmlq._request_flows  # type: ignore[attr-defined]


def test_a_retry_under_a_whole_table_policy_does_not_isolate_every_flow_again() -> None:
    policy = _RaisingPolicy("reevaluate", per_flow=False)
    calls = []
    reevaluate = policy.reevaluate

    def counted(flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        calls.append(1)
        return reevaluate(flows, ctx)

    policy.reevaluate = counted  # type: ignore[method-assign]
    mono = _MonoClock(100.0)
    state = ClusterState(policy, mono_clock=mono)
    state.open_flows("victim", [_open(i, deadline=1000.0) for i in range(1, 41)], now=100.0)
    state.open_flows("evil", [_open(13, deadline=1000.0)], now=100.0)
    state.flush(100.0)
    assert len(state.quarantined) == 1 and len(calls) > 40  # found out: each flow alone
    calls.clear()
    mono.now += QUARANTINE_RETRY_FIRST
    state.start_sweep(100.0 + QUARANTINE_RETRY_FIRST)  # still raising: tried alone, once
    state.flush(100.0 + QUARANTINE_RETRY_FIRST)
    assert len(state.quarantined) == 1 and len(calls) <= 2, len(calls)


def test_a_flow_that_went_long_without_a_fault_starts_its_waits_afresh() -> None:
    policy = _RaisingPolicy("reevaluate")
    mono = _MonoClock(100.0)
    state = ClusterState(policy, mono_clock=mono)

    def at(now: float) -> float:
        mono.now = now
        return now

    state.open_flows("evil", [_open(13, deadline=5000.0)], now=100.0)
    state.flush(100.0)  # strike 1: retried at 101
    state.start_sweep(at(101.0))
    state.flush(101.0)  # strike 2: retried at 103
    policy.failing = False
    state.start_sweep(at(103.0))
    state.flush(103.0)  # decided again
    assert not state.quarantined
    policy.failing = True
    state.open_flows("evil", [_open(13, deadline=5000.0)], now=at(103.0 + 10))  # a re-sent open
    state.flush(113.0)  # strike 3, soon after the last: 4 s
    assert state.next_retry() == pytest.approx(117.0)
    policy.failing = False
    state.start_sweep(at(117.0))
    state.flush(117.0)
    policy.failing = True
    later = at(117.0 + QUARANTINE_RETRY_MAX)
    state.open_flows("evil", [_open(13, deadline=5000.0)], now=later)
    state.flush(later)  # a new fault after a quiet QUARANTINE_RETRY_MAX: 1 s again
    assert state.next_retry() == pytest.approx(later + QUARANTINE_RETRY_FIRST)


@pytest.mark.parametrize("step", [-3600.0, 0.0, 3600.0])
def test_a_quarantined_flow_is_retried_after_its_wait_whatever_the_wall_clock_did(
    step: float,
) -> None:
    # The retry is a pure delay: a wall clock stepped back (an NTP correction) must not hold
    # the flow in quarantine for as long, nor one stepped forward release it early.
    policy = _RaisingPolicy("reevaluate")
    mono = _MonoClock(5000.0)
    state = ClusterState(policy, mono_clock=mono)
    state.open_flows("evil", [_open(13, deadline=1e6)], now=100.0)
    state.flush(100.0)
    assert state.quarantined
    policy.failing = False
    mono.now += QUARANTINE_RETRY_FIRST / 2
    assert not state.start_sweep(100.0 + step)  # half its wait: still quarantined
    mono.now += QUARANTINE_RETRY_FIRST / 2
    assert state.start_sweep(100.0 + step)
    state.flush(100.0 + step)
    assert not state.quarantined
