"""The decoder's container limits, from the protocol's own maxima.

msgpack checks ``max_array_len``, ``max_map_len``, ``max_bin_len`` and ``max_ext_len`` from a
container's header, so a frame holding a container no message could hold is refused before
any of it is built; the arrays a frame builds are counted too (``MAX_ARRAYS``: one per flow
open and four of the frame's own), so that nesting arrays each within the limit gains
nothing. Both limits must never refuse a legal frame: the largest frame of every message type,
either direction, decodes. docs/security.md has the figures.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgpack
import pytest

from flowsched.model import FlowClass
from flowsched.protocol import (
    MAX_NAME,
    MAX_PROGRESS,
    MESSAGE_TYPES,
    RESYNC_FRAME_OPENS,
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
    LocalProtocolError,
    Message,
    NicLoad,
    NicLoadEntry,
    Resync,
    Welcome,
    decode_body,
    encode_body,
)
from flowsched.protocol._codec import (
    I64_MAX,
    MAC_SIZE,
    MAX_ARRAY,
    MAX_ARRAYS,
    MAX_LINKS,
    MAX_MAP,
    MAX_REASON,
    MAX_UPDATES,
    NONCE_SIZE,
    U64_MAX,
)
from flowsched.protocol._framing import DEFAULT_MAX_FRAME_SIZE

#: the longest name, in four-byte characters (the most bytes a name can take)
NAME = "\U0001f600" * MAX_NAME
MIB = 1 << 20


def _open(index: int, links: int = 1) -> FlowOpen:
    return FlowOpen(
        index, FlowClass.KV, 1.7e9, U64_MAX, U64_MAX, 1.8e9, NAME, I64_MAX, NAME,
        tuple(NAME for _ in range(links)), 255,
    )  # fmt: skip


def _updates(count: int) -> tuple[LevelUpdate, ...]:
    return tuple(LevelUpdate(U64_MAX - i, 255, 1e12, 1.7e9, I64_MAX) for i in range(count))


# The agent sends at most RESYNC_FRAME_OPENS opens and MAX_PROGRESS progress reports and
# closes per frame, the coordinator MAX_UPDATES level updates; the decoder takes MAX_ARRAY of
# each (more than any release sends), each open with its links array.
LARGEST: list[Any] = [
    pytest.param(
        Flows(
            opens=tuple(_open(i) for i in range(MAX_ARRAY)),
            progress_ids=tuple(range(MAX_PROGRESS)),
            progress_sent=(U64_MAX,) * MAX_PROGRESS,
            closes=tuple(FlowClose(U64_MAX - i, U64_MAX, 1.7e9) for i in range(MAX_PROGRESS)),
        ),
        id="flows-every-array-full",
    ),
    pytest.param(
        Flows(opens=tuple(_open(i, MAX_LINKS) for i in range(RESYNC_FRAME_OPENS))),
        id="flows-agent-opens-with-the-most-links",
    ),
    pytest.param(Resync(tuple(_open(i) for i in range(MAX_ARRAY))), id="resync"),
    pytest.param(Levels(_updates(MAX_UPDATES), U64_MAX), id="levels"),
    pytest.param(
        NicLoad(tuple(NicLoadEntry(NAME, 1e12, 1.0) for _ in range(MAX_ARRAY))), id="nic_load"
    ),
    pytest.param(
        Welcome(
            "\U0001f600" * ((DEFAULT_MAX_FRAME_SIZE - 200) // 4),
            1.0,
            1.7e9,
            1.0,
            U64_MAX,
            U64_MAX,
            b"m" * MAC_SIZE,
        ),
        id="welcome-1-MiB-policy",
    ),
    pytest.param(Hello(65535, NAME, b"n" * NONCE_SIZE), id="hello"),
    pytest.param(Challenge(65535, b"n" * NONCE_SIZE), id="challenge"),
    pytest.param(Auth(b"m" * MAC_SIZE), id="auth"),
    pytest.param(Error(NAME, "\U0001f600" * MAX_REASON), id="error"),
    pytest.param(JobProgress(NAME, I64_MAX, I64_MAX, True), id="job_progress"),
    pytest.param(Heartbeat(1.7e9, U64_MAX), id="heartbeat"),
]


def test_the_largest_frames_cover_every_message_type() -> None:
    assert {param.values[0].TYPE for param in LARGEST} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("version", [1, 5])
@pytest.mark.parametrize("message", LARGEST)
def test_the_largest_frame_of_every_message_type_decodes(message: Message, version: int) -> None:
    assert decode_body(encode_body(message, version)) == message


def test_the_largest_flows_frame_builds_exactly_the_arrays_allowed() -> None:
    # one array per open (its links) and the frame's own four: the MAX_ARRAYS budget, to the one
    frame = LARGEST[0].values[0]
    assert len(frame.opens) + 4 == MAX_ARRAYS


def _body(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"t": kind, **fields}, use_bin_type=True)


OVER = MAX_ARRAY + 1
_OPEN = {"id": 1, "cls": "kv", "opened_at": 1.0, "sent": 0}

OVER_LIMIT = [
    pytest.param(
        _body("flows", opens=[{}] * OVER), f"flows.opens: more than {MAX_ARRAY} entries", id="opens"
    ),
    pytest.param(
        _body("flows", closes=[{}] * OVER),
        f"flows.closes: more than {MAX_ARRAY} entries",
        id="closes",
    ),
    pytest.param(
        _body("flows", progress=[{}] * OVER),
        f"flows.progress: more than {MAX_ARRAY} entries",
        id="progress-maps",
    ),
    pytest.param(
        _body("flows", progress_ids=[0] * OVER, progress_sent=[0]),
        f"flows.progress_ids: more than {MAX_ARRAY} entries",
        id="progress_ids",
    ),
    pytest.param(
        _body("flows", progress_ids=[0], progress_sent=[0] * OVER),
        f"flows.progress_sent: more than {MAX_ARRAY} entries",
        id="progress_sent",
    ),
    pytest.param(
        _body("resync", opens=[{}] * OVER),
        f"resync.opens: more than {MAX_ARRAY} entries",
        id="resync",
    ),
    pytest.param(
        _body("levels", updates=[{}] * OVER),
        f"levels.updates: more than {MAX_ARRAY} entries",
        id="updates",
    ),
    pytest.param(
        _body("nic_load", entries=[{}] * OVER),
        f"nic_load.entries: more than {MAX_ARRAY} entries",
        id="nic-entries",
    ),
    pytest.param(
        _body("flows", opens=[_OPEN, {**_OPEN, "links": ["a"] * OVER}]),
        f"flows.opens[1].links: more than {MAX_ARRAY} entries",
        id="links",
    ),
    pytest.param(
        _body("flows", junk=[0] * OVER), f"flows.?: more than {MAX_ARRAY} entries", id="unknown-key"
    ),
    pytest.param(
        _body("flows", opens=[{**_OPEN, **{f"x{i}": 0 for i in range(MAX_MAP - 3)}}]),
        f"flows.opens[0]: more than {MAX_MAP} keys",
        id="open-map",
    ),
    pytest.param(
        _body("welcome", **{f"x{i}": 0 for i in range(MAX_MAP)}),
        f"welcome: more than {MAX_MAP} keys",
        id="message-map",
    ),
    pytest.param(
        _body("hello", version=5, node="n", nonce=b"n" * (NONCE_SIZE + 1)),
        "hello.nonce: more than 32 bytes of bin",
        id="nonce",
    ),
    pytest.param(
        _body("auth", mac=b"m" * (MAC_SIZE + 1)), "auth.mac: more than 32 bytes of bin", id="mac"
    ),
    pytest.param(
        _body("heartbeat", t_sent=msgpack.ExtType(1, b"x")),
        "heartbeat.t_sent: an extension type",
        id="ext",
    ),
    pytest.param(
        _body("flows", opens=[[[]] * MAX_ARRAY] * 2),  # each array within MAX_ARRAY
        f"frame: more than {MAX_ARRAYS} arrays",
        id="nested-arrays",
    ),
]


@pytest.mark.parametrize(("body", "expected"), OVER_LIMIT)
def test_a_container_over_the_limits_is_refused_naming_the_field(
    body: bytes, expected: str
) -> None:
    with pytest.raises(LocalProtocolError) as info:
        decode_body(body)
    assert str(info.value).startswith(expected), str(info.value)
    assert info.value.code == "bad_field"


def test_a_container_beyond_the_walks_reach_is_refused_as_the_frame() -> None:
    # the offending array after more items than the error's walk reads: named as the frame
    body = _body("flows", closes=[0] * MAX_ARRAY, opens=[{}] * OVER)
    with pytest.raises(LocalProtocolError, match=r"^frame: a container over the protocol's"):
        decode_body(body)


_ENTRIES = MIB - 64


def _frame_of(inner: bytes) -> bytes:
    """``{"t": "flows", "opens": [...]}`` holding ``inner`` (one byte) ~1 MiB times."""
    header = _ENTRIES.to_bytes(4, "big")
    return b"\x82\xa1t\xa5flows\xa5opens\xdd" + header + inner * _ENTRIES


def _nested_arrays() -> bytes:
    """The same million empty arrays, as arrays of MAX_ARRAY (each within the limit)."""
    chunk = b"\xdc" + MAX_ARRAY.to_bytes(2, "big") + b"\x90" * MAX_ARRAY
    count = _ENTRIES // len(chunk)
    return b"\x82\xa1t\xa5flows\xa5opens\xdc" + count.to_bytes(2, "big") + chunk * count


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(_frame_of(b"\x90"), id="a-million-empty-arrays"),
        pytest.param(_frame_of(b"\x80"), id="a-million-empty-maps"),
        pytest.param(_frame_of(b"\xc0"), id="a-million-nils"),
        pytest.param(_nested_arrays(), id="nested-arrays-each-within-the-limit"),
    ],
)
def test_a_frame_no_message_could_be_is_refused_before_it_is_built(body: bytes) -> None:
    """What the decoder allocates for a 1 MiB hostile frame before refusing it (a million
    empty lists were ~64 MB, and 160-180 ms of the coordinator's loop)."""
    tracemalloc.start()
    try:
        with pytest.raises(LocalProtocolError):
            decode_body(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * MIB, f"{peak / MIB:.1f} MiB allocated"
