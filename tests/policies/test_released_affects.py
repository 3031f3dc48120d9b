"""``released_affects``: a flow's release changes no decision or ``next_change`` it does not name.

At the instant of a full evaluation (so that time, rho and Algorithm 1 stay put and only the
release differs), release one flow and re-evaluate every other flow: each flow whose decision
or promotion time moves must be named by the hook. That is what lets a caller re-evaluate only
the named flows at a close instead of the rest of the job (policies/base.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_flows import build_flow

from flowsched import policies
from flowsched.model import Context, Flow, FlowClass
from flowsched.policies.base import Policy

#: (policy, args) pairs: rmlq in each configuration whose hook names flows, and the per-flow
#: baselines whose hook names none
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("rmlq", {}),
    ("rmlq", {"mlu_scope": "request"}),
    ("rmlq", {"volume_check": True, "pace_layers": 0}),
    ("rmlq", {"mlu_scope": "request", "volume_check": True, "feasibility_check": "alg1"}),
    ("rmlq", {"mlu_scope": "request", "rho_source": "others", "urgent_order": "slack"}),
    ("static", {"drop_late": True}),
    ("fair", {}),
    ("karuna", {}),
    ("pias", {}),
    ("sjf", {}),
]
LINKS = [("a/tx", "b/rx"), ("a/tx", "c/rx"), ("b/tx", "c/rx")]
CLASSES = [FlowClass.KV, FlowClass.KV, FlowClass.PARAM_SYNC, FlowClass.TP, FlowClass.EXPERIENCE]

flow_specs = st.lists(
    st.tuples(
        st.sampled_from(CLASSES),
        st.integers(1 << 10, 64 << 20),  # size
        st.floats(-0.01, 0.2),  # deadline - now
        st.integers(0, 3),  # request
        st.integers(0, 12),  # consumer_index
        st.integers(0, len(LINKS) - 1),
        st.floats(0.0, 1.0),  # share of the size sent
    ),
    min_size=2,
    max_size=24,
)


def context(now: float, job_index: Mapping[str, int]) -> Context:
    return Context(now, dict(job_index), {"a/tx": 1e9, "b/tx": 1e9}, {}, 1e9)


def build(specs: list[tuple[Any, ...]], now: float) -> list[Flow]:
    """Flows of one job (in prefill at step 2) from ``specs``; kv/param_sync carry a
    deadline, size, request and layer index."""
    flows = []
    for fid, (cls, size, ahead, request, index, path, share) in enumerate(specs, start=1):
        explicit = cls in (FlowClass.KV, FlowClass.PARAM_SYNC)
        flow = build_flow(
            fid, cls, opened_at=now - 0.05, size=size, sent=int(size * share), job="j",
            deadline=now + ahead if explicit else None, consumer_index=index,
            request=f"r{request}" if explicit else None, links=LINKS[path],
        )  # fmt: skip
        flows.append(flow)
    return flows


def released_moves(
    name: str,
    args: dict[str, Any],
    specs: list[tuple[Any, ...]],
    pick: int,
    hook: Callable[[Policy, Flow], Any] | None = None,
) -> list[str]:
    """Admit and fully evaluate ``specs``'s flows, release the ``pick``-th at that instant,
    re-evaluate the others: the flows whose decision or next_change moved without the hook
    (``policy.released_affects``, or ``hook``) naming them."""
    policy = policies.create(name, args)
    now, jobs = 10.0, {"j": 2}
    flows = build(specs, now - 0.02)
    ctx = context(now - 0.02, jobs)
    for flow in flows:  # opened 20 ms ago, at level of their admission
        flow.level = policy.admit(flow, ctx).level
    ctx = context(now, jobs)
    for flow in flows:
        flow.sent = min(flow.size or 0, flow.sent + (1 << 20))  # bytes since: rho, MLU move
    for fid, decision in policy.reevaluate(flows, ctx).items():
        flows[fid - 1].level = decision.level
    next_change = getattr(policy, "next_change", None)
    before = {f.flow_id: next_change(f, ctx) if next_change else None for f in flows}
    closed = flows[pick % len(flows)]
    policy.release(closed, ctx)
    rest = [f for f in flows if f is not closed]
    answer = (hook or type(policy).released_affects)(policy, closed)
    named = {f.flow_id for f in rest} if answer is None else set(answer)  # None: the whole job
    changes = policy.reevaluate(rest, ctx)
    moved = []
    for flow in rest:
        if flow.flow_id in named:
            continue
        if flow.flow_id in changes:
            moved.append(f"flow {flow.flow_id}: level {flow.level} -> {changes[flow.flow_id]}")
        elif next_change is not None and next_change(flow, ctx) != before[flow.flow_id]:
            moved.append(f"flow {flow.flow_id}: next_change moved from {before[flow.flow_id]}")
    return moved


@pytest.mark.parametrize(("name", "args"), CONFIGS, ids=[f"{n}{a}" for n, a in CONFIGS])
@settings(max_examples=150, deadline=None)
@given(specs=flow_specs, pick=st.integers(0, 1 << 10))
def test_a_release_moves_only_the_flows_the_hook_names(
    name: str, args: dict[str, Any], specs: list[tuple[Any, ...]], pick: int
) -> None:
    assert released_moves(name, args, specs, pick) == []


def _none(policy: Policy, flow: Flow) -> tuple[int, ...]:
    return ()


#: a request-scope request of two kv flows on one path, the second the deeper layer: its
#: release leaves the first with less of the request's bytes (MLU and promotion time move)
SIBLINGS = [
    (FlowClass.KV, 8 << 20, 0.1, 0, 3, 0, 0.0),
    (FlowClass.KV, 8 << 20, 0.1, 0, 7, 0, 0.0),
]


@pytest.mark.parametrize(
    ("args", "specs", "pick"),
    [
        ({"mlu_scope": "request"}, SIBLINGS, 1),
        ({"volume_check": True, "pace_layers": 0}, SIBLINGS, 1),
    ],
)
def test_a_hook_that_leaves_a_moved_flow_out_is_caught(
    args: dict[str, Any], specs: list[tuple[Any, ...]], pick: int
) -> None:
    """The check above is not vacuous: rmlq's own hook passes these cases, one naming
    nothing fails them."""
    assert released_moves("rmlq", args, specs, pick) == []
    assert released_moves("rmlq", args, specs, pick, hook=_none) != []


def test_policies_that_rank_every_flow_leave_the_whole_job() -> None:
    """edf and llf band flows by rank among all flows: a release moves flows of every job,
    so they define no hook; rmlq with RED tiers is not per-flow and answers None."""
    assert not hasattr(policies.create("edf"), "released_affects")
    assert not hasattr(policies.create("llf"), "released_affects")
    red = policies.create("rmlq", {"red_tiers": 2})
    assert red.released_affects(build_flow(1, FlowClass.KV)) is None  # type: ignore[attr-defined]
