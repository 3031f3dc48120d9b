"""Length-prefixed framing: 4-byte big-endian body length, then the msgpack body."""

from __future__ import annotations

from typing import Final

from flowsched.protocol._util import LocalProtocolError

#: Default maximum body size of one frame (bytes); both directions.
DEFAULT_MAX_FRAME_SIZE: Final = 1 << 20
#: Maximum body size of a frame from a peer that has not authenticated yet (``hello`` and
#: ``auth`` are under 300 bytes): an unauthenticated peer can make us buffer no more than this.
HANDSHAKE_MAX_FRAME_SIZE: Final = 4096
HEADER_SIZE: Final = 4


def frame(body: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Prefix ``body`` with its length; refuse bodies over ``max_frame_size``."""
    if len(body) > max_frame_size:
        raise LocalProtocolError(
            f"frame of {len(body)} bytes exceeds the maximum of {max_frame_size}",
            code="frame_too_large",
        )
    return len(body).to_bytes(HEADER_SIZE, "big") + body


class ReceiveBuffer:
    """Accumulates received bytes and cuts them into frame bodies.

    The length header is checked as soon as it arrives, so an oversized frame is rejected
    before its body is buffered.
    """

    __slots__ = ("_buf", "_max", "_start")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self._buf = bytearray()
        self._start = 0
        self._max = max_frame_size

    @property
    def max_frame_size(self) -> int:
        """Largest body accepted; applies to every frame whose header is not yet checked."""
        return self._max

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        self._max = value

    def __len__(self) -> int:
        return len(self._buf) - self._start

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes."""
        if self._start and self._start >= len(self._buf) // 2:
            del self._buf[: self._start]
            self._start = 0
        self._buf += data

    def next_body(self) -> bytes | None:
        """The next complete frame body, or None if more data is needed.

        Raises:
            LocalProtocolError: the next frame announces a body of 0 bytes or more than the
                maximum frame size.
        """
        start = self._start
        if len(self._buf) - start < HEADER_SIZE:
            return None
        size = int.from_bytes(self._buf[start : start + HEADER_SIZE], "big")
        if size == 0 or size > self._max:
            raise LocalProtocolError(
                f"frame header announces {size} bytes (allowed 1..{self._max})",
                code="frame_too_large" if size else "bad_frame",
            )
        end = start + HEADER_SIZE + size
        if len(self._buf) < end:
            return None
        self._start = end
        return bytes(self._buf[start + HEADER_SIZE : end])
