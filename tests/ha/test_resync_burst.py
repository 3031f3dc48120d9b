"""A new leader's rebuild: resyncs are admitted at once, re-evaluated once per burst."""

from __future__ import annotations

import pytest

from flowsched.coordinator.config import CoordinatorConfig
from flowsched.coordinator.state import ClusterState
from flowsched.model import FlowClass
from flowsched.protocol import FlowOpen


class CountingPolicy:
    """Level 5 at admission, 3 after any re-evaluation; counts the re-evaluated flows."""

    name = "counting"
    num_levels = 8
    per_flow_decisions = True

    def __init__(self) -> None:
        self.reevaluated: list[int] = []

    def admit(self, flow: object, ctx: object) -> object:
        from flowsched.model import Decision

        return Decision(5)

    def reevaluate(self, flows: list[object], ctx: object) -> dict[int, object]:
        from flowsched.model import Decision

        self.reevaluated += [f.flow_id for f in flows]  # type: ignore[attr-defined]
        return {f.flow_id: Decision(3) for f in flows}  # type: ignore[attr-defined]

    def release(self, flow: object, ctx: object) -> None:
        pass


def _opens(count: int) -> tuple[FlowOpen, ...]:
    return tuple(FlowOpen(i, FlowClass.KV, 1.0, links=("l",)) for i in range(count))


@pytest.mark.parametrize("defer", [False, True])
def test_resynced_flows_get_admission_levels_at_once(defer: bool) -> None:
    policy = CountingPolicy()
    state = ClusterState(policy)  # type: ignore[arg-type]
    for node in ("a", "b", "c"):
        state.resync(node, _opens(4), 10.0, defer=defer)
        outbox = state.flush(10.0)
        assert {u.level for u in outbox[node].values()} == {3 if not defer else 5}
    assert len(policy.reevaluated) == (0 if defer else 12)
    state.settle_resyncs()
    outbox = state.flush(11.0)
    if defer:  # one re-evaluation of the whole burst, its changes sent
        assert sorted(policy.reevaluated) == sorted(state.flows)
        assert sum(len(updates) for updates in outbox.values()) == 12
    assert not state.resynced


def test_a_flow_closed_before_the_burst_settles_is_skipped() -> None:
    policy = CountingPolicy()
    state = ClusterState(policy)  # type: ignore[arg-type]
    state.resync("a", _opens(3), 10.0, defer=True)
    state.resync("a", _opens(1), 10.1, defer=True)  # the node's complete set shrank
    state.settle_resyncs()
    state.flush(10.2)
    assert policy.reevaluated == list(state.flows)
    assert len(state.flows) == 1


def test_rebuild_batching_is_on_by_default_and_can_be_turned_off() -> None:
    factory = CountingPolicy
    assert CoordinatorConfig(token=b"t", policy_factory=factory).rebuild_batching  # type: ignore[arg-type]
    baseline = CoordinatorConfig(token=b"t", policy_factory=factory, rebuild_batching=False)  # type: ignore[arg-type]
    assert not baseline.rebuild_batching
