"""An authenticated but hostile agent against a real coordinator, with a real agent connected.

The peer holds the token, so it gets past the handshake, and then sends frames built to be
costly to decode: a legal-size (1 MiB) ``flows`` frame whose ``opens`` holds a million empty
maps (msgpack decodes each byte into a dict: ~75 MB of objects), as arrays of MAX_ARRAY maps
(a single array that long is refused from its header); or a million empty arrays, flat or
nested, which the decoder's limits refuse before building them. The coordinator refuses each
(``bad_field``) and ends that connection only; it must keep nothing it decoded, and build
nothing it need not. Resident memory comes from ``/proc/<pid>/status``; figures are printed
(``-s``).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from e2e_helpers import scrape, total, wait_for
from test_preauth_floods import (
    MIB,
    Setup,
    Watch,
    agent_counters,
    assert_agent_never_dropped,
    coordinator_and_agent,
    rss_bytes,
)

from flowsched.model import FlowClass
from flowsched.protocol import (
    MAX_NAME,
    NEED_DATA,
    Challenge,
    Connection,
    Error,
    FlowOpen,
    Flows,
    Message,
    Role,
    Welcome,
    load_token,
)
from flowsched.protocol._codec import MAX_ARRAY, MAX_ARRAYS, MAX_LINKS
from flowsched.protocol._framing import HEADER_SIZE
from flowsched.protocol.aio import connect_agent

pytestmark = pytest.mark.slow

_ENTRIES = (1 << 20) - 64


def _nested(inner: bytes) -> bytes:
    """``{"t": "flows", "opens": [[x, x, ...], ...]}`` of ~1 MiB (the largest body allowed),
    ``x`` being ``inner`` (one byte), each inner array MAX_ARRAY long (within the limit)."""
    chunk = b"\xdc" + MAX_ARRAY.to_bytes(2, "big") + inner * MAX_ARRAY
    count = _ENTRIES // len(chunk)
    return b"\x82\xa1t\xa5flows\xa5opens\xdc" + count.to_bytes(2, "big") + chunk * count


#: a million empty maps, built (each array is within the limits) and then refused
EMPTY_MAPS_FRAME = _nested(b"\x80")
_EMPTY_MAPS = EMPTY_MAPS_FRAME.count(b"\x80")
#: ``{"t": "flows", "opens": [[], [], ...]}``: a million empty arrays in one array
FLAT_ARRAYS_FRAME = (
    b"\x82\xa1t\xa5flows\xa5opens\xdd" + _ENTRIES.to_bytes(4, "big") + b"\x90" * _ENTRIES
)


def _next_message(sock: socket.socket, conn: Connection) -> Message:
    while (event := conn.next_event()) is NEED_DATA:
        data = sock.recv(65536)
        conn.receive_data(data)
        assert data, "the coordinator closed the connection without an error frame"
    assert isinstance(event, Message), event
    return event


def send_after_handshake(address: tuple[str, int], token: bytes, node: str, body: bytes) -> Error:
    """Log in as ``node`` with the token, send ``body`` as one sealed frame, and return the
    coordinator's ``error`` answer (heartbeats before it are skipped)."""
    conn = Connection(Role.AGENT, token=token)
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(conn.hello(node))
        challenge = _next_message(sock, conn)
        assert isinstance(challenge, Challenge)
        sock.sendall(conn.answer(challenge))
        assert isinstance(_next_message(sock, conn), Welcome)
        sock.sendall(conn.send_frame("flows", len(body).to_bytes(HEADER_SIZE, "big") + body))
        while not isinstance(answer := _next_message(sock, conn), Error):
            pass
    return answer


def _wait_refused(mport: str, frames: int) -> None:
    wait_for(
        lambda: (
            total(
                scrape(mport), "flowsched_coordinator_closed_connections_total", reason="bad_field"
            )
            == frames
        ),
        10,
        "the coordinator to count every refused frame",
    )


def peak_rss_bytes(pid: int) -> int:
    """The most resident memory ``pid`` ever had (VmHWM): a peak no sampling can miss."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def _send_each_as_a_new_node(
    setup: Setup, token: Path, body: bytes, frames: int
) -> Iterator[Error]:
    """The coordinator's answers to ``body`` sent ``frames`` times, each after a handshake of
    its own under a new node name (``hostile-N``), as a token holder would."""
    for index in range(frames):
        yield send_after_handshake(setup.address, load_token(str(token)), f"hostile-{index}", body)


def test_refused_costly_frames_leave_nothing_decoded_behind(tmp_path: Path, token: Path) -> None:
    frames = 12
    with coordinator_and_agent(tmp_path, token) as setup:
        pid, mport = setup.coordinator.proc.pid, setup.coordinator.fields["mport"]
        before, rss_before = agent_counters(setup.agent), rss_bytes(pid)
        with Watch(pid, [setup.agent]).running() as watch:
            for answer in _send_each_as_a_new_node(setup, token, EMPTY_MAPS_FRAME, frames):
                assert answer.code == "bad_field" and "flows.opens[0]" in answer.reason
        _wait_refused(mport, frames)
        rss_after = rss_bytes(pid)
        print(
            f"\n{frames} refused 1 MiB frames of {_EMPTY_MAPS:,} empty maps from an "
            f"authenticated peer: coordinator RSS {rss_before / MIB:.1f} MiB before, peak "
            f"{watch.rss_peak / MIB:.1f} MiB, after {rss_after / MIB:.1f} MiB; agent "
            f"disconnected in {watch.disconnected_samples} of {watch.samples} samples"
        )
        assert_agent_never_dropped(setup, before, watch)
    # each refused frame's decoded maps (~75 MB) stayed until a full garbage collection,
    # which gc.freeze() at start makes rare: 12 frames grew the coordinator by ~900 MB
    assert rss_after - rss_before < 256 * MIB


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param(FLAT_ARRAYS_FRAME, f"flows.opens: more than {MAX_ARRAY} entries", id="flat"),
        pytest.param(_nested(b"\x90"), f"frame: more than {MAX_ARRAYS} arrays", id="nested"),
    ],
)
def test_frames_of_empty_arrays_are_refused_before_they_are_built(
    tmp_path: Path, token: Path, body: bytes, reason: str
) -> None:
    """Ten frames of a million empty arrays each (160-180 ms of decoding apiece, ~64 MB of
    lists) in a row made the connected agent lose its link: the decoder's limits refuse
    them from their headers, or at the array past MAX_ARRAYS."""
    frames = 10
    with coordinator_and_agent(tmp_path, token) as setup:
        pid, mport = setup.coordinator.proc.pid, setup.coordinator.fields["mport"]
        before, peak_before = agent_counters(setup.agent), peak_rss_bytes(pid)
        with Watch(pid, [setup.agent]).running() as watch:
            for answer in _send_each_as_a_new_node(setup, token, body, frames):
                assert answer.code == "bad_field" and answer.reason.startswith(reason)
        _wait_refused(mport, frames)
        peak_after = peak_rss_bytes(pid)
        print(
            f"\n{frames} refused 1 MiB frames of empty arrays: coordinator peak RSS "
            f"{peak_before / MIB:.1f} -> {peak_after / MIB:.1f} MiB; agent disconnected in "
            f"{watch.disconnected_samples} of {watch.samples} samples"
        )
        assert_agent_never_dropped(setup, before, watch)
    # building a frame's million lists took the peak up by ~60 MB or more
    assert peak_after - peak_before < 16 * MIB


def _invented_links_open(index: int, node: str) -> FlowOpen:
    """A flow naming its node's egress and 63 invented ~250-character ingress links, with the
    longest job and a request of its own: the most a token holder could make one flow cost."""
    links = (f"{node}:tx", *(f"{'d' * 240}{index}-{j}:rx" for j in range(MAX_LINKS - 1)))
    return FlowOpen(
        index, FlowClass.KV, time.time(), size=1 << 30, deadline=time.time() + 3600,
        job="j" * MAX_NAME, request=f"{'r' * 240}{index}", links=links,
    )  # fmt: skip


async def _open_flows(
    address: tuple[str, int], token: bytes, node: str, frames: int, until: Callable[[int], None]
) -> int:
    """Log in as ``node``, send ``frames`` frames of such opens, and hold the connection until
    ``until(opens sent)`` returns (closing it with frames unread would reset it)."""
    link = await connect_agent(*address, node=node, token=token)
    try:
        for frame in range(frames):
            base = frame * OPENS_PER_FRAME
            opens = tuple(_invented_links_open(base + i, node) for i in range(OPENS_PER_FRAME))
            await link.send(Flows(opens=opens))
        await asyncio.to_thread(until, frames * OPENS_PER_FRAME)
    finally:
        await link.close()
    return frames * OPENS_PER_FRAME


#: opens of 64 links (~16 KB each) that fit a 1 MiB frame
OPENS_PER_FRAME = 60


def test_flows_naming_invented_links_are_refused_past_the_nodes_bounds(
    tmp_path: Path, token: Path
) -> None:
    """37 KiB per flow before: 65,534 such flows took the coordinator to 2.4 GB."""
    with coordinator_and_agent(tmp_path, token) as setup:
        pid, mport = setup.coordinator.proc.pid, setup.coordinator.fields["mport"]
        before, rss_before = agent_counters(setup.agent), rss_bytes(pid)
        with Watch(pid, [setup.agent]).running() as watch:
            # a node's flows may name 16,385 distinct links (its egress and every ingress a
            # coordinator of 16,384 connections serves): 1 + 63 new ones per flow
            kept = (16_385 - 1) // (MAX_LINKS - 1)

            def all_refused(sent: int) -> None:
                wait_for(
                    lambda: (
                        total(scrape(mport), "flowsched_coordinator_refused_flows_total")
                        == sent - kept
                    ),
                    30,
                    "the coordinator to refuse the flows past the node's link names",
                )

            sent = asyncio.run(
                _open_flows(setup.address, load_token(str(token)), "hostile", 40, all_refused)
            )
        rss_after = rss_bytes(pid)
        print(
            f"\n{sent} opens of {MAX_LINKS} links ({kept} kept): coordinator RSS "
            f"{rss_before / MIB:.1f} -> {rss_after / MIB:.1f} MiB (peak {watch.rss_peak / MIB:.1f})"
        )
        assert_agent_never_dropped(setup, before, watch)
        assert "refused for their names" in (tmp_path / "coordinator.log").read_text()
    # 2,400 such flows kept were ~87 MiB
    assert rss_after - rss_before < 32 * MIB
