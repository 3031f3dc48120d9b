"""bench/coordinator_memory.py's shapes: what each names and how much of it the coordinator
keeps (the memory figures themselves are the benchmark's business, not a test's)."""

from __future__ import annotations

import pytest
from bench_script_loader import load_bench_script

from flowsched.coordinator.state import LINKS_PER_FLOW, MAX_JOBS_PER_NODE, MAX_LINK_NAMES_PER_NODE
from flowsched.protocol._codec import MAX_NAME

memory = load_bench_script("coordinator_memory.py")


# (shape, opens sent, kept): the invented links pass the node's distinct-link bound after
# MAX_LINK_NAMES_PER_NODE // 63 flows
@pytest.mark.parametrize(
    ("shape", "sent", "kept"),
    [("real", 400, 400), ("costliest", 400, 400), ("invented", 300, MAX_LINK_NAMES_PER_NODE // 63)],
)
def test_each_shape_keeps_what_the_bounds_allow(shape: str, sent: int, kept: int) -> None:
    row = memory.measure(shape, sent)
    assert (row["kept"], row["refused"]) == (kept, sent - kept)


def test_the_costliest_shape_names_the_most_the_bounds_allow() -> None:
    opens = [op for batch in memory.batches("costliest", 20_000) for op in batch]
    links = {link for op in opens for link in op.links}
    names = links | {op.job for op in opens} | {op.request for op in opens}
    assert all(len(op.links) == LINKS_PER_FLOW for op in opens)
    assert len(links) == MAX_LINK_NAMES_PER_NODE - 1
    assert len({op.job for op in opens}) == MAX_JOBS_PER_NODE
    assert len({op.request for op in opens}) == len(opens)
    assert all(240 <= len(name) <= MAX_NAME for name in names)
    assert all(max(map(ord, name[:200])) > 0xFFFF for name in names)  # four bytes each


def test_every_name_is_a_new_string() -> None:
    (batch,) = memory.batches("real", 17)
    first, same_job = batch[0], batch[16]
    assert first.job == same_job.job and first.job is not same_job.job
