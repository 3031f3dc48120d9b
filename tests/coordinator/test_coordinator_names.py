"""What a node's flows name is kept once and bounded (ClusterState's NodeNames).

A real node's flows name its egress and their peers' ingress links (1-3 each), a few jobs,
and requests their flows share. A token holder could name 63 invented ~250-character links
per flow, each flow new ones: 65,534 such flows took the coordinator from 35.6 to 2,423 MiB
(docs/security.md). Each name is now kept once per node, and a node's flows may name at most
``max_link_names_per_node`` distinct links, LINKS_PER_FLOW per allowed flow in all, and
MAX_JOBS_PER_NODE distinct jobs; an open beyond is refused like one past the flow cap.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from flowsched.coordinator import state as state_module
from flowsched.coordinator.state import LINKS_PER_FLOW, ClusterState
from flowsched.model import FlowClass
from flowsched.policies import create
from flowsched.protocol import FlowClose, FlowOpen

NODE = "n1"


def _fresh(text: str) -> str:
    """``text`` as a new string object (as each decoded frame gives one)."""
    return "".join(list(text))


def _open(wire_id: int, links: tuple[str, ...], job: str | None = None, **kw: Any) -> FlowOpen:
    return FlowOpen(
        wire_id, FlowClass.KV, time.time(), links=tuple(_fresh(link) for link in links),
        job=None if job is None else _fresh(job), **kw,
    )  # fmt: skip


def _state(**kw: Any) -> ClusterState:
    return ClusterState(create("rmlq"), **kw)


def test_names_that_flows_repeat_are_kept_once() -> None:
    state = _state()
    opens = [
        _open(i, (f"{NODE}:tx", "n2:rx"), job="job-a", request=_fresh("job-a/r1")) for i in range(3)
    ]
    assert state.open_flows(NODE, opens, time.time()) == 0
    flows = [state.flows[fid] for fid in state.by_node[NODE].values()]
    for attribute in ("job", "request"):
        assert len({id(getattr(flow, attribute)) for flow in flows}) == 1, attribute
    for index in range(2):
        assert len({id(flow.links[index]) for flow in flows}) == 1, index


def _links(first: int, count: int) -> tuple[str, ...]:
    return (f"{NODE}:tx", *(f"peer{first + i}:rx" for i in range(count - 1)))


# (state keywords, the opens in order, how many are admitted)
CASES = [
    pytest.param(
        {"max_link_names_per_node": 5},
        [_open(i, _links(2 * i, 3)) for i in range(4)],  # 1 + 2 new links each
        2,
        id="distinct-links",
    ),
    pytest.param(
        {"max_flows_per_node": 2},  # room for 2 * LINKS_PER_FLOW links in all
        [_open(i, _links(0, LINKS_PER_FLOW + 1)) for i in range(3)],
        1,
        id="links-in-all",
    ),
    pytest.param(
        {},
        [_open(i, _links(0, 2), job=f"job-{i}") for i in range(5)],  # MAX_JOBS_PER_NODE is 3
        3,
        id="distinct-jobs",
    ),
]


@pytest.mark.parametrize(("kwargs", "opens", "admitted"), CASES)
def test_opens_past_a_nodes_name_bounds_are_refused(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], opens: list[FlowOpen], admitted: int
) -> None:
    monkeypatch.setattr(state_module, "MAX_JOBS_PER_NODE", 3)
    state = _state(**kwargs)
    refused = state.open_flows(NODE, opens, time.time())
    assert (len(state.by_node[NODE]), refused) == (admitted, len(opens) - admitted)
    assert state.stats.refused_for_names == state.stats.refused_opens == refused
    # the bounds count open flows only: once the node's flows close, the same opens fit again
    state.close_flows(NODE, [FlowClose(op.id, 0, time.time()) for op in opens], time.time())
    assert NODE not in state.node_names
    again = [_open(op.id + 100, op.links, op.job) for op in opens]
    assert state.open_flows(NODE, again, time.time()) == len(opens) - admitted


def test_a_real_nodes_flows_are_never_refused_for_their_names() -> None:
    # a full node at the default bounds: 2-3 links each over 1,000 peers, 64 jobs, requests of
    # four flows each
    state = _state(max_flows_per_node=20_000)
    opens = [
        _open(i, _links(i % 1000, 2 + i % 2), job=f"job-{i % 64}", request=f"req-{i // 4}")
        for i in range(20_000)
    ]
    assert state.open_flows(NODE, opens, time.time()) == 0
    names = state.node_names[NODE]
    # its egress and 1,001 peers (0..999, and 1..1000 for the flows of 3 links)
    assert (len(names.links), len(names.jobs), len(names.requests)) == (1002, 64, 5000)
