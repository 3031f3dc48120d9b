"""An authenticated but hostile agent against a real coordinator, with a real agent connected.

The peer holds the token, so it gets past the handshake, and then sends frames built to be
costly to decode: a legal-size (1 MiB) ``flows`` frame whose ``opens`` array holds a million
empty maps (msgpack decodes each byte into a dict: ~75 MB of objects). The coordinator
refuses each (``bad_field``) and ends that connection only; it must keep nothing it decoded.
Resident memory comes from ``/proc/<pid>/status``; figures are printed (``-s``).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from e2e_helpers import scrape, total, wait_for
from test_preauth_floods import (
    MIB,
    Watch,
    agent_counters,
    assert_agent_never_dropped,
    coordinator_and_agent,
    rss_bytes,
)

from flowsched.protocol import (
    NEED_DATA,
    Challenge,
    Connection,
    Error,
    Message,
    Role,
    Welcome,
    load_token,
)
from flowsched.protocol._framing import HEADER_SIZE

pytestmark = pytest.mark.slow

#: ``{"t": "flows", "opens": [{}, {}, ...]}`` filling a 1 MiB body (the largest allowed)
_EMPTY_MAPS = 1_000_000
EMPTY_MAPS_FRAME = (
    b"\x82\xa1t\xa5flows\xa5opens\xdd" + _EMPTY_MAPS.to_bytes(4, "big") + b"\x80" * _EMPTY_MAPS
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


def test_refused_costly_frames_leave_nothing_decoded_behind(tmp_path: Path, token: Path) -> None:
    frames = 12
    with coordinator_and_agent(tmp_path, token) as setup:
        pid, mport = setup.coordinator.proc.pid, setup.coordinator.fields["mport"]
        before, rss_before = agent_counters(setup.agent), rss_bytes(pid)
        with Watch(pid, [setup.agent]).running() as watch:
            for index in range(frames):
                answer = send_after_handshake(
                    setup.address, load_token(str(token)), f"hostile-{index}", EMPTY_MAPS_FRAME
                )
                assert answer.code == "bad_field" and "flows.opens[0]" in answer.reason
        wait_for(
            lambda: (
                total(
                    scrape(mport),
                    "flowsched_coordinator_closed_connections_total",
                    reason="bad_field",
                )
                == frames
            ),
            10,
            "the coordinator to count every refused frame",
        )
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
