"""Hypothesis strategies producing valid protocol messages (shared by the protocol tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from flowsched.model import FlowClass
from flowsched.protocol import (
    Auth,
    Challenge,
    Error,
    FlowClose,
    FlowOpen,
    Flows,
    Heartbeat,
    Hello,
    JobProgress,
    Levels,
    LevelUpdate,
    Message,
    NicLoad,
    NicLoadEntry,
    Resync,
    Welcome,
)

u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(0, 2**63 - 1)
times = st.floats(0.0, 4e9, allow_nan=False, allow_infinity=False)
names = st.text(st.characters(codec="utf-8", categories=["L", "N", "P"]), min_size=1, max_size=40)
links = st.lists(names, max_size=4).map(tuple)

flow_opens = st.builds(
    FlowOpen,
    id=u64,
    cls=st.sampled_from(list(FlowClass)),
    opened_at=times,
    sent=u64,
    size=st.none() | u64,
    deadline=st.none() | times,
    job=st.none() | names,
    consumer_index=st.none() | i64,
    request=st.none() | names,
    links=links,
    level=st.none() | st.integers(0, 255),
)
#: progress reports as (id, sent) pairs
progress_pairs = st.lists(st.tuples(u64, u64), max_size=5)


def flows_with(pairs: list[tuple[int, int]], **entries: object) -> Flows:
    """A ``flows`` message whose progress reports are ``pairs``."""
    ids = tuple(fid for fid, _ in pairs)
    return Flows(progress_ids=ids, progress_sent=tuple(sent for _, sent in pairs), **entries)  # type: ignore[arg-type]


flows = st.builds(
    flows_with,
    progress_pairs,
    opens=st.lists(flow_opens, max_size=3).map(tuple),
    closes=st.lists(st.builds(FlowClose, u64, u64, times), max_size=3).map(tuple),
)
nic_entries = st.builds(
    NicLoadEntry, names, st.floats(0.0, 1e12, allow_nan=False), st.floats(0.0, 1.0)
)
level_updates = st.builds(
    LevelUpdate, u64, st.integers(0, 255), st.none() | st.floats(0.0, 1e12, allow_nan=False)
)

#: a hello's nonce or a welcome's MAC: absent (below version 3) or 32 bytes
nonces = st.just(b"") | st.binary(min_size=32, max_size=32)

messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, st.integers(0, 65535), names, nonces),
    st.builds(Challenge, st.integers(0, 65535), st.binary(min_size=32, max_size=32)),
    st.builds(Auth, st.binary(min_size=32, max_size=32)),
    st.builds(
        Welcome,
        st.text(max_size=200),
        times,
        times,
        times,
        mac=nonces,
    ),
    st.builds(Error, names, st.text(max_size=200)),
    flows,
    st.builds(JobProgress, names, i64, st.none() | i64, st.booleans()),
    st.builds(NicLoad, st.lists(nic_entries, max_size=4).map(tuple)),
    st.builds(Resync, st.lists(flow_opens, max_size=3).map(tuple)),
    st.builds(Levels, st.lists(level_updates, max_size=5).map(tuple)),
    st.builds(Heartbeat, times),
)
