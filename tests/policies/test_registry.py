"""Every registered policy: module shape, the Policy protocol, levels always in 0..K-1."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_flows import build_flow

from flowsched.model import Context, FlowClass
from flowsched.policies import ORACLES, Policy, create, module, names

#: the smallest K each policy supports with its default arguments
MIN_LEVELS = {"rmlq": 7}


@pytest.mark.parametrize("name", names())
def test_module_shape_and_protocol(name: str) -> None:
    mod = module(name)
    assert name == mod.NAME
    assert mod.validate({}, "policy.args") == []
    errors = mod.validate({"no_such_arg": 1}, "policy.args")
    assert errors and all(e.startswith("policy.args.no_such_arg: unknown key") for e in errors)
    policy = create(name, {}, num_levels=8)
    assert isinstance(policy, Policy)
    assert policy.name == name
    assert policy.num_levels == 8


def test_registry_lists_every_policy_and_the_oracle() -> None:
    assert set(names()) == {"rmlq", "fair", "static", "pias", "sjf", "edf", "karuna", "llf"}
    assert {"llf"} == ORACLES
    with pytest.raises(KeyError, match="unknown policy"):
        module("wfq")


flows_strategy = st.lists(
    st.tuples(
        st.sampled_from(list(FlowClass)),
        st.one_of(st.none(), st.integers(0, 10**11)),
        st.integers(0, 10**11),
        st.one_of(st.none(), st.floats(-1.0, 10.0)),
        st.one_of(st.none(), st.integers(0, 20)),
        st.sampled_from([None, "a", "b"]),
        st.one_of(st.none(), st.floats(-1.0, 10.0)),
    ),
    max_size=20,
)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(names()),
    extra_levels=st.integers(0, 10),
    specs=flows_strategy,
    now=st.floats(0.0, 5.0),
    job_index=st.integers(0, 20),
    load=st.floats(0.0, 1.0),
)
def test_every_decision_is_within_levels(
    name: str,
    extra_levels: int,
    specs: list[tuple[Any, ...]],
    now: float,
    job_index: int,
    load: float,
) -> None:
    num_levels = MIN_LEVELS.get(name, 1) + extra_levels
    policy = create(name, {}, num_levels=num_levels)
    flows = [
        build_flow(
            i,
            cls=c,
            size=s,
            sent=min(sent, s) if s is not None else sent,
            deadline=d,
            job="j",
            consumer_index=ci,
            request=r,
            oracle_deadline=o,
            links=("x",),
        )
        for i, (c, s, sent, d, ci, r, o) in enumerate(specs)
    ]
    context = Context(now=now, job_index={"j": job_index}, link_load={"x": load})
    for flow in flows:
        decision = policy.admit(flow, context)
        assert 0 <= decision.level < num_levels
        assert decision.rate is None or decision.rate > 0
        flow.level = decision.level
    for decision in policy.reevaluate(flows, context).values():
        assert 0 <= decision.level < num_levels
    for flow in flows:
        policy.release(flow, context)


DESCRIBE_CASES = [(n, k) for n in names() for k in (1, 2, 8, 12) if k >= MIN_LEVELS.get(n, 1)]


@pytest.mark.parametrize(("name", "num_levels"), DESCRIBE_CASES)
def test_describe_levels_has_one_line_per_level(name: str, num_levels: int) -> None:
    policy = create(name, {}, num_levels=num_levels)
    lines = policy.describe_levels()  # type: ignore[attr-defined]
    assert len(lines) == num_levels
    assert all(isinstance(line, str) and line for line in lines)


#: arguments under which a policy decides each flow on its own (rmlq: its defaults, Algorithm 1
#: pruning on)
PER_FLOW_ARGS: dict[str, dict[str, Any]] = {"rmlq": {}}
PER_FLOW = [
    n
    for n in names()
    if getattr(create(n, PER_FLOW_ARGS.get(n, {}), num_levels=8), "per_flow_decisions", 0)
]


def test_per_flow_policies_are_the_expected_ones() -> None:
    assert set(PER_FLOW) == {"fair", "static", "sjf", "pias", "karuna", "rmlq"}
    mlu_check = {"feasibility_check": "mlu"}
    for args in (mlu_check, {"red_tiers": 2, "feasibility": False}):  # cross-flow rules
        assert not create("rmlq", args, num_levels=12).per_flow_decisions  # type: ignore[attr-defined]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(PER_FLOW),
    specs=flows_strategy,
    now=st.floats(0.0, 5.0),
    job_index=st.integers(0, 20),
    picks=st.lists(st.booleans(), min_size=20, max_size=20),
)
def test_per_flow_policies_decide_a_subset_as_they_decide_everything(
    name: str, specs: list[tuple[Any, ...]], now: float, job_index: int, picks: list[bool]
) -> None:
    """The coordinator passes only touched flows to such policies: results must not differ
    (a decision for a flow not passed, such as a pruned request's other flow, is the one the
    whole table gives it)."""

    def flows() -> list[Any]:
        return [
            build_flow(
                i,
                cls=c,
                size=s,
                sent=min(sent, s) if s is not None else sent,
                deadline=d,
                job="j",
                consumer_index=ci,
                request=r,
                links=("x",),
            )
            for i, (c, s, sent, d, ci, r, _) in enumerate(specs)
        ]

    context = Context(now=now, job_index={"j": job_index})
    everything, subset = flows(), flows()
    args = PER_FLOW_ARGS.get(name, {})
    whole, part = create(name, args, num_levels=8), create(name, args, num_levels=8)
    for policy, group in ((whole, everything), (part, subset)):
        for flow in group:
            flow.level = policy.admit(flow, Context(now=0.0)).level
    full = whole.reevaluate(everything, context)
    chosen = [f for f, keep in zip(subset, picks, strict=False) if keep]
    partial = part.reevaluate(chosen, context)
    picked = {f.flow_id for f in chosen}
    assert {fid: d for fid, d in partial.items() if fid in picked} == {
        fid: full[fid] for fid in picked if fid in full
    }
    assert all(full.get(fid) == d for fid, d in partial.items() if fid not in picked)
