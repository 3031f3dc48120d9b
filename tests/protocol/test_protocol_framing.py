"""Framing: length prefix, partial reads, maximum frame size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowsched.protocol import LocalProtocolError, ReceiveBuffer, frame


@given(st.lists(st.binary(min_size=1, max_size=300), max_size=8), st.integers(1, 64))
def test_frames_survive_any_split(bodies: list[bytes], chunk: int) -> None:
    stream = b"".join(frame(body) for body in bodies)
    buffer = ReceiveBuffer()
    received = []
    for start in range(0, len(stream), chunk):
        buffer.feed(stream[start : start + chunk])
        while (body := buffer.next_body()) is not None:
            received.append(body)
    assert received == bodies
    assert len(buffer) == 0


def test_oversized_frame_rejected_from_its_header_alone() -> None:
    buffer = ReceiveBuffer(max_frame_size=1000)
    buffer.feed((1001).to_bytes(4, "big"))  # no body needed to reject
    with pytest.raises(LocalProtocolError, match="announces 1001 bytes") as info:
        buffer.next_body()
    assert info.value.code == "frame_too_large"


def test_empty_frame_rejected() -> None:
    buffer = ReceiveBuffer()
    buffer.feed(b"\x00\x00\x00\x00")
    with pytest.raises(LocalProtocolError, match="announces 0 bytes"):
        buffer.next_body()


def test_sender_refuses_oversized_body() -> None:
    with pytest.raises(LocalProtocolError, match="exceeds the maximum of 10"):
        frame(b"x" * 11, max_frame_size=10)
